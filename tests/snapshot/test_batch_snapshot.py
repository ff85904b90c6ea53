"""A batch continuing one loaded KV snapshot (engine/batch.py load_kv, snapshot/store.py load_rows): the
snapshot is read once and its prefix goes into every row whose prompt starts with it, so questions about
one document prefill only themselves; every row is what it would be alone (greedy token for token, sampled
by chi-square), whatever its prompt shares with the snapshot."""
from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import tforce
from tforce.cli import app
from tforce.config import RunConfig, Sampling, Speculation
from tforce.engine.session import Session
from tforce.snapshot import identity as snapshot_identity, store as snapshot_io

from chat_helpers import models  # noqa: F401 (fixture)
from exactness_helpers import BATCH_SAMPLING, PROMPT, ROWS, draw_rows, pvalues
from model_helpers import ids
from snapshot_helpers import GREEDY, METHODS

DOC = ids(40)
# rows: two questions after the document, the document alone (its last token is fed again for the first
# token's logits), a prompt leaving the document after 20 tokens, an unrelated one (nothing reused)
PROMPTS = [DOC + ids(7, seed=1), DOC + ids(3, seed=2), DOC, DOC[:20] + ids(9, seed=3), ids(30, seed=4)]
REUSED = [40, 40, 39, 20, 0]


@pytest.fixture(scope="module")
def doc_snapshots(tiny, tmp_path_factory):
    """method -> a snapshot of DOC (its caches hold all 40 tokens), made by generate."""
    root = tmp_path_factory.mktemp("doc")
    for method in METHODS:
        tforce.generate(tiny["gqa"], DOC, draft=tiny["draft"], method=method, save_kv=root / method,
                        **dict(GREEDY, max_new_tokens=0))
    return root


@pytest.mark.parametrize("offload", ["off", "on"])
@pytest.mark.parametrize("method", METHODS)
def test_rows_loaded_from_one_snapshot_give_each_prompts_own_tokens(tiny, doc_snapshots, method, offload):
    """Each row: the tokens of its prompt alone (with or without the snapshot), and the drafts, acceptance
    and reuse of its prompt alone loading the same snapshot (`--load-kv`: the same caches to start from)."""
    kw = dict(draft=tiny["draft"], method=method, offload=offload, **GREEDY)
    snap = doc_snapshots / method
    rows = tforce.generate_batch(tiny["gqa"], PROMPTS, load_kv=snap, **kw)
    for prompt, row, reused in zip(PROMPTS, rows, REUSED):
        alone = tforce.generate(tiny["gqa"], prompt, load_kv=snap, **kw)
        assert row.tokens == alone.tokens == tforce.generate(tiny["gqa"], prompt, **kw).tokens
        assert (row.stats["kv_reused"], row.stats["kv_snapshot_tokens"]) == (reused, 40) == \
            (alone.stats["kv_reused"], alone.stats["kv_snapshot_tokens"])
        for key in ("acceptance", "verifications", "rebuilds"):
            assert row.stats[key] == alone.stats[key], (key, prompt)


def _session(tiny, method, prompts):
    """A session of a row per prompt, with the options the snapshots were made with."""
    spec = Speculation(method=method, **{k: v for k, v in GREEDY.items() if k in Speculation.__dataclass_fields__})
    return Session(tiny["gqa"].model, tiny["draft"].model, max(map(len, prompts)), 8, RunConfig(speculation=spec, sampling=Sampling(temperature=0)), rows=len(prompts))


def _loaded(tiny, path, method, prompts):
    """_session right after load_rows (each row's last token left for the prefill): (session, load_rows')."""
    session = _session(tiny, method, prompts)
    ident = snapshot_identity.identity(tiny["gqa"], tiny["draft"])
    return session, snapshot_io.load_rows(path, session, [torch.tensor(p) for p in prompts],
                                          [len(p) - 1 for p in prompts], ident)


def _held(session, name, b):
    """What the streaming node `name` holds in row b: its count, offset and K/V slots."""
    node = next(n for n in session.streaming_nodes() if n.name == name)
    used = node.cache._used(b)
    return node.held(b), node.cache.offset[b], node.cache.k[:, b, :used], node.cache.v[:, b, :used]


@pytest.mark.parametrize("method", ["triforce", "streaming"])
def test_streaming_caches_go_to_the_rows_that_can_roll_back_to_what_they_share(tiny, doc_snapshots, method):
    """The snapshot's streaming caches (the draft's; --method streaming's middle) hold its state at the
    document's end: restored into every row whose prompt shares tokens with the document and can roll back
    to them (the prefill then feeds only the rest), the others fed from the start, by the rule one prompt's
    load follows: each row holds exactly what its prompt's one-row session holds after the same load. The
    rows holding the whole document hold what feeding the document computes (the restored K/V are the
    snapshot's)."""
    prompts = PROMPTS + [DOC[:38] + ids(5, seed=5)]  # leaves the document 2 tokens before its end: in reach
    session, (reused, length) = _loaded(tiny, doc_snapshots / method, method, prompts)
    assert (reused, length) == (REUSED + [38], 40)
    assert [session.full.held(b) for b in range(len(prompts))] == REUSED + [38]
    fed = _session(tiny, method, [DOC])
    fed.prefill([DOC])
    for node in session.streaming_nodes():
        held = [node.held(b) for b in range(len(prompts))]
        assert held[:3] == [40, 40, 40] and held[4] == 0 and held[5] == 40, (node.name, held)
        assert all(torch.equal(node.tokens[b, :40], torch.tensor(DOC)) for b in (0, 1, 2, 5))
        for b, prompt in enumerate(prompts):
            alone, _ = _loaded(tiny, doc_snapshots / method, method, [prompt])
            mine, its = _held(session, node.name, b), _held(alone, node.name, 0)
            assert mine[:2] == its[:2] and torch.equal(mine[2], its[2]) and torch.equal(mine[3], its[3]), \
                (node.name, b)
        mine, its = _held(session, node.name, 0), _held(fed, node.name, 0)
        assert mine[:2] == its[:2], (node.name, mine[:2], its[:2])
        torch.testing.assert_close(mine[2:], its[2:])


def test_sampled_rows_from_a_snapshot_match_their_target_distributions(small_vocab, tmp_path):
    """The sampled batch of test_batch.py (rows of 23, 9 and 2 tokens) continuing a snapshot of its
    first row's 9 tokens: the first two rows start with it, the third does not."""
    target, draft = small_vocab
    opts = {k: v for k, v in BATCH_SAMPLING.items() if k not in ("temperature", "top_p", "top_k")}
    tforce.generate(target, PROMPT[:9], draft=draft, method="triforce", max_new_tokens=0, save_kv=tmp_path / "s",
                    **opts)
    samples, acc = draw_rows(target, draft, "triforce", seed=4, load_kv=tmp_path / "s")
    assert min(pvalues(target, samples)) > 1e-3
    assert 0.1 < acc < 0.95, acc
    assert ROWS[1] == PROMPT[:9] and ROWS[0][:9] == PROMPT[:9]


def test_run_batch_loads_a_snapshot(models, tmp_path):
    """`tforce run --batch FILE --load-kv SNAP`: each row's JSON as without the snapshot, with its reuse."""
    base = ["run", "-m", str(models / "tiny-target"), "--draft", str(models / "tiny-draft"), "--method", "triforce",
            "-n", "8", "--temperature", "0"]
    doc = (models / "doc.txt").read_text()
    snap = tmp_path / "doc.kv"
    saved = CliRunner().invoke(app, base + [str(models / "doc.txt"), "--save-kv", str(snap), "-n", "0", "--json"])
    assert saved.exit_code == 0, saved.output
    batch = tmp_path / "q.jsonl"
    questions = ["And then?", "Why?"]
    batch.write_text("".join(json.dumps({"id": i, "prompt": doc + q}) + "\n" for i, q in enumerate(questions)))
    loaded = CliRunner().invoke(app, base + ["--batch", str(batch), "--load-kv", str(snap)])
    fresh = CliRunner().invoke(app, base + ["--batch", str(batch)])
    assert loaded.exit_code == fresh.exit_code == 0, loaded.output
    rows, again = ([json.loads(line) for line in r.stdout.splitlines()] for r in (loaded, fresh))
    assert [r["text"] for r in rows] == [r["text"] for r in again]
    prompt_tokens = json.loads(saved.stdout)["prompt_tokens"]
    assert all(r["stats"]["kv_reused"] == prompt_tokens for r in rows)
    assert "reused" in loaded.stderr
