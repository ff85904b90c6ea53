"""The live view as a person sees it: `tforce run` under a pseudo-terminal, every byte it writes fed to a
terminal emulator (pyte). The streamed text must stay on screen in full, and the status must show speed and
acceptance while tokens are still arriving, not only at the end."""
from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from tforce.cli import app
from tforce.model.defaults import demo_pair
from tforce.text.demo import demo_prompt

from live_helpers import COLS, spawn, squash, watch

pyte = pytest.importorskip("pyte")

ARGS = ["-t", "0", "--threads", "1"]


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    try:
        demo_pair()
    except Exception as e:  # the trained demo pair (models/) is part of the checkout: its absence is a failure
        pytest.fail(str(e))
    path = tmp_path_factory.mktemp("live") / "prompt.txt"
    path.write_text(demo_prompt(), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def expected(prompt_file) -> str:
    """The greedy text from a --json run: every method's greedy output is plain decoding's."""
    r = CliRunner().invoke(app, ["run", str(prompt_file), "--method", "ar", "--json", "-n", "40", *ARGS])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)["text"]


def _mid_run(snapshots, need: list[str]) -> list[str]:
    """The snapshots taken while tokens were still to come (the status says k/n tokens, k < n, and the final
    summary, which says how long prefill took, is not there yet) that show every string in need."""
    seen = []
    for lines in snapshots:
        text = "\n".join(lines)
        counts = [(int(k), int(n)) for k, n in re.findall(r"\b(\d+)/(\d+) tokens", text)]
        final = re.search(r"prefill \d+ tokens in", text)
        if any(k < n for k, n in counts) and not final and all(s in text for s in need):
            seen.append(text)
    return seen


@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_text_stays_on_screen_and_status_updates_mid_run(prompt_file, expected, method):
    assert len(expected) > COLS  # long enough to wrap
    proc, master = spawn([str(prompt_file), "--method", method, "-n", "40", *ARGS])
    screen, snapshots, _ = watch(proc, master)
    final = "\n".join(screen.display)
    assert proc.returncode == 0, final
    assert squash(expected) in squash(final), f"generated text not all on screen:\n{expected!r}\n---\n{final}"
    need = ["s/token"] + (["accept"] if method == "triforce" else [])
    assert _mid_run(snapshots, need), f"no mid-run status with {need}; last snapshots:\n" + "\n".join(
        "\n".join(s) for s in snapshots[-3:])
    assert "tokens/s" in final and screen.margins is None  # the summary stays; the whole screen scrolls again


def test_piped_stdout_gets_only_the_text_while_the_terminal_shows_the_status(prompt_file, expected):
    proc, master = spawn([str(prompt_file), "--method", "triforce", "-n", "40", *ARGS], stdout_tty=False)
    screen, snapshots, out = watch(proc, master)
    assert proc.returncode == 0, "\n".join(screen.display)
    assert out.decode("utf-8") == expected
    assert _mid_run(snapshots, ["s/token", "accept"]), "\n".join(screen.display)


def _before_first_token(snapshots) -> list[str]:
    """Screens from before the first token: a prefill field, no decode count (k/n tokens) and no summary."""
    texts = ["\n".join(lines) for lines in snapshots]
    return [t for t in texts if "prefill" in t and not re.search(r"(?<!prefill )\b\d+/\d+ tokens", t)
            and not re.search(r"prefill \d+ tokens in", t)]


def test_placement_shows_during_prefill(prompt_file):
    """The KV cache's placement is on screen before the first token (the engine reports its plan before
    prefill, on_plan), not only in the final panel; it stays there to the end."""
    proc, master = spawn([str(prompt_file), "--method", "triforce", "-n", "8", *ARGS])
    screen, snapshots, _ = watch(proc, master)
    final = "\n".join(screen.display)
    assert proc.returncode == 0, final
    early = _before_first_token(snapshots)
    assert any("layers on device" in t for t in early), "\n---\n".join(early[-3:])
    assert "layers on device" in final


def test_status_fields_carry_the_plan_from_the_start():
    from tforce.cli.live import Status

    status = Status([100], [8], "triforce")
    assert status.fields() == ["prefill 0/100 tokens"]
    status.on_plan({"kv_resident_layers": 2, "kv_offloaded_layers": 3, "kv_device_bytes": 1, "kv_host_bytes": 1})
    status.on_prefill(10, 100)
    assert status.fields() == ["prefill 10/100 tokens", "KV cache: 2/5 layers on device, 3 in host"]


def test_one_row_status_from_the_engine_rounds(monkeypatch):
    """One prompt is one row of the same status: s/token and tokens/s over the tokens after the prefill's,
    acceptance from the levels' counts, tokens per verification over the rounds after the first; then the
    run's own final figures."""
    from tforce.cli import live

    clock = iter([10.0, 12.0])
    monkeypatch.setattr(live.time, "perf_counter", lambda: next(clock))
    status = live.Status([50], [8], "triforce")
    status.on_prefill(50, 50)  # decoding starts (10.0)
    status.on_round({0: [1]}, {"draft": (0, 0), "retrieval": (0, 0)})  # the prefill's token
    status.on_round({0: [2, 3, 4]}, {"draft": (3, 4), "retrieval": (2, 3)})
    status.on_round({0: [5]}, {"draft": (3, 6), "retrieval": (2, 4)})
    # at 12.0: 4 tokens decoded in 2 s over 2 verifications
    assert status.fields() == ["5/8 tokens", "0.5000 s/token", "2.0 tokens/s", "accept draft 50.0%",
                               "accept retrieval 50.0%", "2.00 tokens/verification"]
    status.final = {"prefill_s": 1.5, "ms_per_token": 400.0, "tokens_per_s": 2.5, "tokens_per_verification": 2.25,
                    "kv_resident_layers": 2, "kv_offloaded_layers": 0}
    assert status.fields() == ["prefill 50 tokens in 1.50 s", "5/8 tokens", "0.4000 s/token", "2.5 tokens/s",
                               "accept draft 50.0%", "accept retrieval 50.0%", "2.25 tokens/verification",
                               "KV cache: 2/2 layers on device, 0 in host"]


def test_ctrl_c_keeps_the_text_and_gives_the_screen_back(prompt_file, expected):
    def shown(lines) -> int:  # how much of the text (its first 40 tokens) the screen holds
        text, want = squash("\n".join(lines)), squash(expected)
        return max((k for k in range(len(want) + 1) if want[:k] in text), default=0)

    at_interrupt = []

    def interrupt(lines):
        if _mid_run([lines], ["s/token"]) and shown(lines) > 0:
            at_interrupt.append(shown(lines))
            return True
        return False

    proc, master = spawn([str(prompt_file), "--method", "ar", "-n", "600", *ARGS])  # seconds: Ctrl-C comes mid-run
    screen, _, _ = watch(proc, master, interrupt=interrupt)
    final = screen.display
    assert at_interrupt and proc.returncode == 130, "\n".join(final)
    assert shown(final) >= at_interrupt[0]  # nothing written before Ctrl-C was erased
    assert any(line.startswith("tforce: interrupted") for line in final)  # on a line of its own
    assert screen.margins is None


class _Terminal:
    """A file whose writes go to a pyte screen: what a terminal shows of stdout and stderr together."""

    def __init__(self, cols: int, rows: int):
        self.screen = pyte.Screen(cols, rows)
        self.stream = pyte.Stream(self.screen)

    def write(self, s: str) -> None:
        self.stream.feed(s.replace("\n", "\r\n"))  # as a tty's output processing (onlcr) does

    def flush(self) -> None:
        pass


def test_pinned_status_never_overwrites_text(monkeypatch):
    """Text written in chunks, wrapping and scrolling, with the status redrawn after every chunk; a chunk that
    ends exactly at the right margin (the cursor waiting to wrap) defers the redraw, since restoring the
    cursor loses that wait on some terminals (pyte among them) and the next character would overwrite."""
    from tforce.cli import pinned

    cols, rows = 20, 10
    monkeypatch.setattr(pinned, "terminal_size", lambda out: (cols, rows))
    term = _Terminal(cols, rows)
    status = pinned.PinnedStatus(term, height=2)
    text, drawn = "", []
    for chunk in ["a" * cols, "b" * 7, "c" * 13, "d" * 5, "\n" + "e" * 45, "f" * 15, "g" * 3, "\nh"]:
        term.write(chunk)
        text += chunk
        drawn.append(status.draw([f"status {len(text)}", "second row"], text))
    assert drawn == [False, True, False, True, True, False, True, True]  # no redraw where a row was just filled
    shown = [line.rstrip() for line in term.screen.display]
    assert shown[-2:] == [f"status {len(text)}", "second row"]
    wrapped = [line[i:i + cols] for line in text.split("\n") for i in range(0, max(len(line), 1), cols)]
    assert shown[:len(wrapped)] == wrapped
    status.close()
    assert term.screen.margins is None
    assert all(line.strip() == "" for line in term.screen.display[-2:])
