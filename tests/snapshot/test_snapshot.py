"""KV snapshots (tforce/snapshot/format.py, snapshot/store.py, snapshot/identity.py) and conversations
(tforce/engine/conversation.py): a reused or loaded cache gives the answers a fresh prefill gives, greedy token for
token and sampled by chi-square; every refusal."""
import json
import shutil

import numpy as np
import pytest
import torch

import tforce
from tforce.snapshot import identity as snapshot_identity, store as snapshot_io
from tforce.engine.conversation import Conversation
from tforce.engine.generate import Session
from tforce.errors import TforceError, UsageError
from tforce.model.synthetic import make_checkpoint
from tforce.config import RunConfig

from exactness_helpers import N_TOKENS, PROMPT, SAMPLES, SAMPLING, SMALL, check, exact_joint
from model_helpers import ids
from snapshot_helpers import GREEDY, METHODS

CONV = {k: v for k, v in GREEDY.items() if k != "max_new_tokens"}  # a Conversation's options


@pytest.fixture(scope="module")
def saved(tiny, tmp_path_factory):
    """method -> a snapshot of the first 40 tokens' prompt (the caches hold all 40: the prefill's last forward
    gave the first token), made by generate."""
    root = tmp_path_factory.mktemp("snap")
    out = {}
    for method in METHODS:
        out[method] = root / method
        tforce.generate(tiny["gqa"], ids(40), draft=tiny["draft"], method=method, save_kv=out[method], **GREEDY)
    return out


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("offload", ["off", "on"])
def test_loaded_snapshot_gives_the_fresh_greedy_tokens(tiny, saved, method, offload):
    """A prompt extending the prefix prefills only the rest; the same prompt prefills nothing; the
    snapshot was made on-device and loads into a cache in host memory too."""
    kw = dict(draft=tiny["draft"], method=method, offload=offload, **GREEDY)
    for prompt in (ids(40), ids(40) + ids(17, seed=1)):
        fresh = tforce.generate(tiny["gqa"], prompt, **kw)
        loaded = tforce.generate(tiny["gqa"], prompt, load_kv=saved[method], **kw)
        assert loaded.tokens == fresh.tokens
        # all 40 held tokens, but for the same prompt its last token, fed again for the first token's logits
        assert loaded.stats["kv_reused"] == min(40, len(prompt) - 1)


@pytest.mark.parametrize("method", METHODS)
def test_snapshot_restores_streaming_caches_without_refeeding(tiny, saved, method):
    """The draft's (and --method streaming's middle) StreamingCache comes from the snapshot: after loading,
    prefill feeds those nodes only the tokens after the prefix (one forward each)."""
    prompt = torch.tensor(ids(40) + ids(5, seed=1))
    session = Session(tiny["gqa"].model, tiny["draft"].model, len(prompt), 8, RunConfig(speculation=tforce.config.Speculation(method=method, **SMALL), sampling=tforce.config.Sampling(temperature=0)))
    snapshot_io.load(saved[method], session, prompt, len(prompt) - 1, snapshot_identity.identity(tiny["gqa"], tiny["draft"]))
    session.prefill([prompt])
    for node in (session.small, session.middle if method == "streaming" else None):
        if node is not None:
            assert node.forwards == 1, node.name
    assert session.full.forwards == 1


def test_prompt_leaving_the_prefix_reuses_the_common_part(tiny, saved):
    """The chosen behaviour: no refusal; the common prefix is reused and the rest prefilled (stats say how
    much), the streaming caches being rebuilt; the tokens are the fresh ones."""
    prompt = ids(40)[:25] + ids(20, seed=2)
    kw = dict(draft=tiny["draft"], method="triforce", **GREEDY)
    loaded = tforce.generate(tiny["gqa"], prompt, load_kv=saved["triforce"], **kw)
    assert loaded.stats["kv_reused"] == 25
    assert loaded.tokens == tforce.generate(tiny["gqa"], prompt, **kw).tokens


@pytest.mark.parametrize("method,offload", [(m, "off") for m in METHODS] + [("triforce", "on")])
@pytest.mark.parametrize("keep_history", [False, True])
def test_conversation_answers_are_the_fresh_greedy_answers(tiny, method, offload, keep_history):
    """Each answer equals generate() over the same prompt (the document, [earlier turns,] the question),
    whatever came before: a one-token question, longer ones, the caches rolled back past the streaming
    caches' reach; the full cache on the device or in host memory."""
    doc = ids(45)
    kw = dict(draft=tiny["draft"], method=method, offload=offload, **CONV)
    conv = Conversation(tiny["gqa"], doc, room=200, keep_history=keep_history, **kw)
    history = list(doc)
    for n, seed in ((1, 3), (9, 4), (3, 5)):
        question = ids(n, seed=seed)
        got = conv.ask(question, max_new_tokens=24)
        assert got.tokens == tforce.generate(tiny["gqa"], history + question, max_new_tokens=24, **kw).tokens
        # the question, and with the history kept the last answer's last token (no forward fed it)
        assert got.stats["prefilled_tokens"] <= n + keep_history and got.stats["ttft_s"] > 0
        if keep_history:
            history += question + got.tokens


def test_conversation_saves_and_loads_its_document(tiny, tmp_path):
    doc, question = ids(45), ids(6, seed=7)
    kw = dict(draft=tiny["draft"], method="triforce", **CONV)
    first = Conversation(tiny["gqa"], doc, room=100, save_kv=tmp_path / "doc", **kw).ask(question, 24)
    again = Conversation(tiny["gqa"], None, room=100, load_kv=tmp_path / "doc", **kw)
    assert again.document == doc and again.kv_reused == 45
    assert again.ask(question, 24).tokens == first.tokens


# ---- sampling -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", METHODS)
def test_conversation_sampling_matches_target_distribution(small_vocab, method):
    """One conversation over PROMPT's first 15 tokens answers PROMPT's last 8 again and again: every
    answer comes from caches rolled back to the document, and the samples follow the exact distribution."""
    target, draft = small_vocab
    joint = exact_joint(target, PROMPT, N_TOKENS)
    conv = Conversation(target, PROMPT[:15], draft=draft, room=20, ignore_eos=True, method=method,
                        temperature=SAMPLING.temperature, top_p=SAMPLING.top_p, top_k=SAMPLING.top_k,
                        **dict(SMALL, gamma2=3))
    samples = [tuple(conv.ask(PROMPT[15:], N_TOKENS, seed=i).tokens) for i in range(SAMPLES)]
    assert min(check(samples, joint)) > 1e-3


def test_loaded_snapshot_sampling_matches_target_distribution(small_vocab, tmp_path):
    target, draft = small_vocab
    spec = tforce.config.Speculation(method="triforce", **dict(SMALL, gamma2=3))
    joint = exact_joint(target, PROMPT, N_TOKENS)
    tforce.generate(target, PROMPT[:15], draft=draft, method="triforce", max_new_tokens=0, save_kv=tmp_path / "s",
                    **dict(SMALL, gamma2=3))
    ident = snapshot_identity.identity(target, draft)
    gen = torch.Generator().manual_seed(5)
    samples = []
    for _ in range(SAMPLES):
        session = Session(target, draft, len(PROMPT), N_TOKENS + 8, RunConfig(speculation=spec, sampling=SAMPLING))
        assert snapshot_io.load(tmp_path / "s", session, torch.tensor(PROMPT), len(PROMPT) - 1, ident) == (15, 15)
        session.prefill([PROMPT])
        got = []
        while len(got) < N_TOKENS:
            got += session.round([len(PROMPT) + len(got)], gen)[0]
        samples.append(tuple(got[:N_TOKENS]))
    assert min(check(samples, joint)) > 1e-3


# ---- refusals -----------------------------------------------------------------------------------------

@pytest.fixture()
def snap(tiny, saved, tmp_path):
    """A copy of the triforce snapshot that a test may damage."""
    dst = tmp_path / "snap"
    shutil.copytree(saved["triforce"], dst)
    return dst


def _load(tiny, path, target=None, **kw):
    return tforce.generate(target or tiny["gqa"], ids(40), draft=tiny["draft"], method="triforce", load_kv=path,
                           **dict(GREEDY, **kw))


def test_refuses_another_model(tiny, snap, tmp_path):
    with pytest.raises(UsageError, match="another model .*config differs"):
        _load(tiny, snap, tiny["mha"])
    make_checkpoint(tmp_path / "retrained", seed=99, num_attention_heads=4, num_key_value_heads=2)  # gqa's config
    with pytest.raises(UsageError, match="same config, other weights"):
        _load(tiny, snap, tforce.load_model(str(tmp_path / "retrained")))


def test_refuses_another_dtype(tiny, tiny_dir, snap):
    with pytest.raises(UsageError, match="its cache is float32, this run's is bfloat16"):
        _load(tiny, snap, tforce.load_model(str(tiny_dir / "gqa"), dtype="bfloat16"))


def test_refuses_another_tokenizer(tiny, tiny_dir, tmp_path):
    """Both models freshly loaded: the weights are the same, only the tokenizer files differ."""
    other = tmp_path / "gqa-other-tokenizer"
    shutil.copytree(tiny_dir / "gqa", other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["model_max_length"] = 12345
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    tforce.generate(tforce.load_model(str(tiny_dir / "gqa")), ids(20), method="ar", save_kv=tmp_path / "s", **GREEDY)
    with pytest.raises(UsageError, match="another tokenizer"):
        tforce.generate(tforce.load_model(str(other)), ids(20), method="ar", load_kv=tmp_path / "s", **GREEDY)
    tforce.generate(tforce.load_model(str(tiny_dir / "gqa")), ids(20), method="ar", load_kv=tmp_path / "s", **GREEDY)


@pytest.mark.parametrize("damage", ["truncate", "flip", "manifest"])
def test_refuses_a_damaged_file(tiny, snap, damage):
    name = "manifest.json" if damage == "manifest" else "full-001.safetensors"
    data = bytearray((snap / name).read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        data[-10] ^= 1
    else:
        manifest = json.loads(data)
        manifest["tokens"][3] += 1
        data = json.dumps(manifest).encode()
    (snap / name).write_bytes(bytes(data))
    with pytest.raises(TforceError, match=f"{name} is damaged"):
        _load(tiny, snap)


def test_refuses_what_is_not_a_snapshot(tiny, tmp_path):
    with pytest.raises(UsageError, match="no such snapshot"):
        _load(tiny, tmp_path / "missing")
    with pytest.raises(TforceError, match="not a readable tforce KV snapshot"):
        _load(tiny, tmp_path)


def test_save_never_overwrites_what_is_not_a_snapshot(tiny, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not a tforce KV snapshot; refusing"):
        tforce.generate(tiny["gqa"], ids(10), save_kv=mine, method="ar", **GREEDY)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError, match="refusing"):
        tforce.generate(tiny["gqa"], ids(10), save_kv=tmp_path / "file", method="ar", **GREEDY)


def test_a_failed_save_leaves_the_old_snapshot_and_no_temporary(tiny, tmp_path, monkeypatch):
    """Written into a temporary folder renamed into place: a run killed while writing leaves the previous
    snapshot (or none), never a partial one."""
    path = tmp_path / "s"
    tforce.generate(tiny["gqa"], ids(20), save_kv=path, method="ar", **GREEDY)
    before = (path / "manifest.json").read_bytes()
    write = snapshot_io._write

    def killed(folder, name, tensors):
        if name == "full-001.safetensors":
            raise KeyboardInterrupt
        return write(folder, name, tensors)

    monkeypatch.setattr(snapshot_io, "_write", killed)
    with pytest.raises(KeyboardInterrupt):
        tforce.generate(tiny["gqa"], ids(30), save_kv=path, method="ar", **GREEDY)
    assert (path / "manifest.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    monkeypatch.setattr(snapshot_io, "_write", write)
    tforce.generate(tiny["gqa"], ids(30), save_kv=path, method="ar", **GREEDY)  # a snapshot is replaced
    assert len(json.loads((path / "manifest.json").read_text())["tokens"]) == 30  # the whole prompt
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_save_writes_one_layer_at_a_time(tiny, tmp_path, monkeypatch):
    """Streaming: each file holds one layer (never the whole cache in one extra copy)."""
    sizes = []
    write = snapshot_io._write
    monkeypatch.setattr(snapshot_io, "_write", lambda f, n, t: sizes.append(sum(x.numel() for x in t.values()))
                        or write(f, n, t))
    tforce.generate(tiny["gqa"], ids(40), save_kv=tmp_path / "s", method="ar", **GREEDY)
    cfg = tiny["gqa"].config
    assert len(sizes) == cfg.num_hidden_layers
    assert max(sizes) < 2 * 39 * tiny["gqa"].model.n_kv_heads * tiny["gqa"].model.head_dim + 10 ** 3
    assert np.isclose(sum(sizes), cfg.num_hidden_layers * max(sizes))


@pytest.mark.parametrize("method", ["triforce", "streaming"])
def test_conversation_returns_to_the_document_without_refeeding_it(tiny, method):
    """After an answer longer than the streaming caches can roll back, the next question restores their
    states marked at the document's end: each node is fed the question alone (one forward), and the full
    cache keeps the document."""
    doc = ids(60)
    conv = Conversation(tiny["gqa"], doc, draft=tiny["draft"], room=100, method=method, **CONV)
    conv.ask(ids(4, seed=1), 30)
    s = conv.session
    before = {n.name: n.forwards for n in (s.full, s.middle, s.small) if n is not None}
    assert s.prefill([doc + ids(4, seed=2)]) == [60]
    for node in (s.small, s.middle if method == "streaming" else None):
        if node is not None:
            assert node.forwards - before[node.name] == 1, node.name
