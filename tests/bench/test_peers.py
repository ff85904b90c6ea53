"""`tforce bench --peers hf`: transformers' own generate on the same weights, timed beside tforce's methods,
on the CPU with tiny float32 models: rows in the table, records in the JSON, greedy tokens equal to ar's."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import tforce
from tforce.bench import peers
from tforce.cli import app
from tforce import generate
from tforce.errors import UsageError
from tforce.model.synthetic import make_checkpoint

BENCH = ["bench", "--device", "cpu", "--prompt-len", "120", "--gen-len", "12", "--temperature", "0",
         "--threads", "1"]
RUN = ("hf", "hf-assisted", "hf-lookup")  # hf-offload: CUDA only


@pytest.fixture(scope="module")
def runner():
    return CliRunner()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    make_checkpoint(root / "target", seed=0, num_key_value_heads=2)
    make_checkpoint(root / "draft", seed=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
                    num_key_value_heads=1, num_hidden_layers=1, tokenizer=False)
    return root


def test_peers_table_on_a_checkpoint_pair(runner, pair):
    """Peer rows in the table, each greedy output equal to ar's; hf-offload says why it did not run."""
    result = runner.invoke(app, BENCH + ["-m", str(pair / "target"), "--draft", str(pair / "draft"),
                                           "--methods", "ar,triforce", "--peers", "hf"])
    assert result.exit_code == 0, (result.output, result.exception)
    out = result.stdout
    for peer in RUN:
        assert f"{peer} (peer)" in out and f"  {peer}: tokens vs ar: match" in out, out
    assert "hf-offload (peer)" in out and "not run" in out
    assert "hf-offload: not run: CPU run" in out
    assert "peers: transformers " in out


def test_peers_json(runner):
    result = runner.invoke(app, BENCH + ["--synthetic", "tiny", "--methods", "ar", "--peers", "hf", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    ar = report["runs"][0]
    assert [r["method"] for r in report["runs"]] == ["ar"]  # the peers are apart from tforce's runs
    assert [p["method"] for p in report["peers"]] == list(peers.FAMILIES["hf"])
    for p in report["peers"][:3]:
        assert p["peer"].startswith("transformers ") and p["skipped"] is None, p
        assert p["tokens"] == 12 and p["vs_ar"] == "match" and p["ms_per_token"] > 0 and p["prefill_s"] > 0
        assert p["speedup_vs_ar"] == pytest.approx(ar["ms_per_token"] / p["ms_per_token"])
        assert p["tokens_per_verification"] >= 1
    assert report["peers"][0]["tokens_per_verification"] == 1  # plain decoding: one forward per token
    offload = report["peers"][3]
    assert offload["skipped"].startswith("CPU run") and offload["ms_per_token"] is None


def test_no_peers_by_default(runner):
    result = runner.invoke(app, BENCH + ["--synthetic", "tiny", "--methods", "ar", "--gen-len", "2", "--json"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert json.loads(result.stdout)["peers"] == []


@pytest.mark.parametrize("args, needle", [
    (["--peers", "vllm"], "--peers takes hf"),
    (["--peers", " , "], "--peers takes hf"),
])
def test_bad_peers_are_one_line(runner, args, needle):
    result = runner.invoke(app, BENCH + ["--synthetic", "tiny"] + args)
    assert result.exit_code == 2, (result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tforce: error: ") and needle in lines[0], result.stderr


def test_peers_refuse_ranks(runner, pair):
    result = runner.invoke(app, BENCH + ["-m", str(pair / "target"), "--tp", "2", "--peers", "hf"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "tforce: error: --peers runs in one process: drop --gpus/--tp"


def test_parse_peers():
    assert peers.parse_peers(None) == () and peers.parse_peers("") == ()
    assert peers.parse_peers("hf") == ("hf", "hf-assisted", "hf-lookup", "hf-offload")
    assert peers.parse_peers("hf,hf") == peers.parse_peers("hf")
    with pytest.raises(UsageError):
        peers.parse_peers("hf-lookup")  # a family, not one variant


def test_compare():
    assert peers.compare([1, 2, 3], [1, 2, 3]) == "match"
    assert peers.compare([1, 5, 3], [1, 2, 3]) == "differ at token 1"
    assert peers.compare([1, 2], [1, 2, 3]) == "differ at token 2"
    assert peers.compare([1, 2], None) is None


def test_hf_model_shares_our_weights_and_ignores_eos(pair):
    """The transformers model holds tforce's own tensors; an EOS token in the output does not stop it
    (tforce's ignore_eos), whatever the checkpoint's config says."""
    model = tforce.load_model(str(pair / "target")).model
    ids = list(range(3, 40))
    ar = generate(model, ids, method="ar", max_new_tokens=8, temperature=0, ignore_eos=True).tokens
    model.config.eos_token_id = ar[1]
    run = peers.Runner(model, None, temperature=0, top_p=1, seed=0)
    assert run.target.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert run.target.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    tokens, clock, forwards = run.generate("hf", ids, 8)
    seconds = clock.prefill_s()
    # the streamer saw every new token, one at a time, after the prompt: 7 decoded after the first
    assert [n for _, n in clock.stamps] == [1] * 8 and clock.decode()[1] == 7 and clock.decode()[0] > 0
    assert tokens == ar and seconds > 0 and forwards == 8  # the prompt's, then one per token but the last


def test_prompt_lookup_ignores_eos(pair):
    """hf-lookup runs to the end past an EOS token: with no EOS ids, prompt lookup in transformers before 5.13
    failed (TypeError, isin of None), which ended the whole bench."""
    model = tforce.load_model(str(pair / "target")).model
    ids = list(range(3, 40)) * 2  # repeats for the lookup to draft from
    ar = generate(model, ids, method="ar", max_new_tokens=8, temperature=0, ignore_eos=True).tokens
    model.config.eos_token_id = ar[1]
    tokens, _, _ = peers.Runner(model, None, temperature=0, top_p=1, seed=0).generate("hf-lookup", ids, 8)
    assert tokens == ar


def test_a_peer_transformers_fails_is_one_line():
    """A TypeError inside transformers (its bug in one decoding path) is that peer's reason, not the bench's end."""
    def broken():
        raise TypeError("isin() received an invalid combination of arguments\n * (Tensor elements, ...)")

    assert peers._attempt(broken) == (None, "failed: TypeError: isin() received an invalid combination of arguments")


def test_sampled_peers_are_not_compared(pair):
    """temperature > 0: the same distribution, but another random stream: no token comparison."""
    model = tforce.load_model(str(pair / "target")).model
    cfg = type("Cfg", (), dict(peers=("hf",), temperature=0.8, top_p=0.9, seed=0, gen_len=4))()
    models = type("Models", (), dict(target=model, draft=None, device=torch.device("cpu")))()
    (record,) = peers.run(models, list(range(3, 40)), cfg, [0, 0, 0, 0], 16)
    assert record["vs_ar"] is None and record["tokens"] == 4 and record["skipped"] is None


def test_bf16_note():
    from tforce.cli.bench_table import peer_notes

    base = {"temperature": 0.0, "runs": [{"method": "ar"}]}
    differ = [{"method": "hf", "peer": "transformers 5", "attention": "sdpa", "skipped": None,
               "vs_ar": "differ at token 7"}]
    assert any("bfloat16: rounding differs" in line for line in peer_notes(dict(base, dtype="bfloat16", peers=differ)))
    assert not any("rounding" in line for line in peer_notes(dict(base, dtype="float32", peers=differ)))


@pytest.mark.cuda
def test_peers_on_cuda_include_the_offloaded_cache(runner):
    """On CUDA every hf peer runs, hf-offload with transformers' offloaded cache, each equal to ar in float32."""
    args = ["bench", "--synthetic", "tiny", "--device", "cuda", "--dtype", "float32", "--prompt-len", "300",
            "--gen-len", "12", "--temperature", "0", "--methods", "ar", "--peers", "hf", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, (result.output, result.exception)
    report = json.loads(result.stdout)
    for p in report["peers"]:
        assert p["skipped"] is None and p["vs_ar"] == "match" and p["gpu_mem_gib"] > 0, p


def test_clock_times_the_decode_from_the_first_batch_of_new_tokens(monkeypatch):
    """The peers' ms/token: from the first batch of new tokens to the last, over the tokens after the first
    batch (assisted generation hands out several at once); the prompt's put is not a token."""
    now = iter([10.5, 11.5, 12.0])
    monkeypatch.setattr(peers.time, "perf_counter", lambda: next(now))
    clock = peers._Clock()
    clock.start = 10.0
    clock.put(torch.zeros(1, 50))  # the prompt
    for n in (1, 3, 2):  # at 10.5, 11.5, 12.0
        clock.put(torch.zeros(n))
    assert clock.prefill_s() == 0.5
    assert clock.decode() == (1.5, 5)
    assert peers._Clock().decode() == (0.0, 0) and peers._Clock().prefill_s() is None
