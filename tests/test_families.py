"""Mistral, Qwen2 (with YaRN) and Qwen3 checkpoints written by transformers' own classes in each family's
released layout: our logits equal transformers', greedy `tforce run` equals transformers' generate (ar,
triforce, offloaded, --tp 2), every method and policy equals plain decoding, chat/bench/info work on each,
sampling matches the exact distribution, and what tforce cannot run is refused in one line."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from typer.testing import CliRunner

import tforce
from model_helpers import feed, forward, full_cache, hf_model, random_ids
from tforce.cli import app
from tforce.config import POLICIES
from tforce.peers import no_eos
from tforce.ranks import launch
from tforce.synthetic import make_family_checkpoint

from test_cli import _one_error_line

YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
# Qwen (v1) shipped its own code through auto_map; tforce and transformers must read the plain family instead.
AUTO_MAP = {"AutoConfig": "configuration_remote.RemoteConfig", "AutoModelForCausalLM": "modeling_remote.RemoteLM"}
CHECKPOINTS = {  # name -> (family, make_family_checkpoint overrides)
    "mistral": ("mistral", dict(max_shard_size="50KB")),
    "qwen2": ("qwen2", {}),
    "qwen2-yarn": ("qwen2", dict(max_position_embeddings=4096, rope_scaling=YARN)),
    "qwen3": ("qwen3", dict(auto_map=AUTO_MAP)),
}
DRAFT_OF = {"mistral": "qwen3", "qwen2": "mistral", "qwen2-yarn": "qwen3", "qwen3": "qwen2"}  # across families
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age"
N = 16
SMALL = ["--budget", "16", "--chunk-size", "4", "--draft-budget", "12", "--sinks", "2"]  # below the prompt
SMALL_KW = dict(budget=16, chunk_size=4, draft_budget=12, sinks=2)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    for i, (name, (family, overrides)) in enumerate(CHECKPOINTS.items()):
        make_family_checkpoint(root / name, family, seed=40 + i, **overrides)
    (root / "qwen3" / "configuration_remote.py").write_text("raise RuntimeError('remote code ran')\n")
    (root / "doc.txt").write_text(TEXT)
    return root


@pytest.fixture(scope="module")
def loaded(root):
    return {name: tforce.load_model(str(root / name)) for name in CHECKPOINTS}


@pytest.fixture(scope="module")
def hf_greedy(root, loaded):
    """name -> transformers' greedy continuation (N tokens, no EOS) of TEXT's ids."""
    ids = loaded["qwen2"].tokenizer.encode(TEXT)
    out = {}
    for name in CHECKPOINTS:
        hf = hf_model(root / name)
        got = hf.generate(torch.tensor([ids]), generation_config=no_eos(), max_new_tokens=N, do_sample=False)
        out[name] = got[0, len(ids):].tolist()
    return out


def _run(root, name, *args):
    r = CliRunner().invoke(app, ["run", "-m", str(root / name), "--draft", str(root / DRAFT_OF[name]), "-p", TEXT,
                                 "-t", "0", "-n", str(N), "--ignore-eos", "--device", "cpu", "--json", *args])
    assert r.exit_code == 0, (r.output, r.exception)
    return json.loads(r.stdout)


def _tensor_bytes(path) -> int:
    """Bytes of every tensor in the folder's safetensors files."""
    total = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as sf:
            total += sum(sf.get_tensor(k).nbytes for k in sf.keys())
    return total


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_logits_equal_transformers(root, loaded, name):
    ids = random_ids(40, seed=3)
    with torch.no_grad():
        ref = hf_model(root / name)(ids).logits
    assert ref.std() > 0.5  # not flat: a wrong layer would show
    model = loaded[name].model
    torch.testing.assert_close(forward(model, full_cache(model), ids), ref, atol=1e-4, rtol=0)
    torch.testing.assert_close(feed(model, full_cache(model), ids, [17, 1, 9, 13]), ref, atol=1e-4, rtol=0)


def test_each_family_holds_its_own_layers(root, loaded):
    attn = {name: loaded[name].model.model.layers[0].self_attn for name in CHECKPOINTS}
    assert len(list((root / "mistral").glob("model-*.safetensors"))) > 1
    assert (root / "mistral" / "model.safetensors.index.json").is_file()
    assert attn["mistral"].q_proj.bias is None and attn["mistral"].o_proj.bias is None
    q2 = loaded["qwen2"].model
    assert all(p.bias.abs().min() > 0 for p in (attn["qwen2"].q_proj, attn["qwen2"].k_proj, attn["qwen2"].v_proj))
    assert attn["qwen2"].o_proj.bias is None
    assert q2.lm_head.weight is q2.model.embed_tokens.weight and q2.config.rope_parameters["rope_theta"] == 1e6
    assert loaded["qwen2-yarn"].config.rope_parameters["rope_type"] == "yarn"
    q3 = attn["qwen3"]
    assert q3.head_dim == 32 != loaded["qwen3"].config.hidden_size // q3.n_heads
    assert q3.q_norm.weight.shape == (32,) and not torch.allclose(q3.q_norm.weight, torch.ones(32))
    assert q3.q_proj.bias is None


@pytest.mark.parametrize("name, remove", [("qwen2", "bias"), ("qwen3", "q_norm"), ("qwen2-yarn", "yarn")])
def test_a_missing_difference_changes_the_logits(root, loaded, name, remove):
    """The comparison above can fail: without the q/k/v biases, the q/k norms or YaRN, the logits move."""
    model = loaded[name].model
    ids = random_ids(40, seed=3)
    ref = forward(model, full_cache(model), ids)
    if remove == "yarn":
        cfg = tforce.weights.read_config(root / "qwen2")
        cache = full_cache(model, rotary=tforce.rope.Rotary(cfg, 128))
        assert (forward(model, cache, ids) - ref).abs().max() > 1e-2
        return
    attn = model.model.layers[0].self_attn
    saved = {k: v.clone() for k, v in attn.state_dict().items()}
    with torch.no_grad():
        for key, p in attn.state_dict().items():
            if key.endswith(".bias") if remove == "bias" else key.startswith(("q_norm", "k_norm")):
                p.fill_(0.0 if remove == "bias" else 1.0)
    try:
        assert (forward(model, full_cache(model), ids) - ref).abs().max() > 1e-2
    finally:
        attn.load_state_dict(saved)


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("method", ["ar", "triforce"])
def test_cli_greedy_equals_transformers_generate(root, hf_greedy, name, method):
    out = _run(root, name, "--method", method, *SMALL)
    assert out["tokens"] == hf_greedy[name]
    assert out["prompt_tokens"] > 16  # the retrieval budget: it drops tokens


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3"])
def test_cli_offloaded_equals_transformers_generate(root, hf_greedy, name):
    out = _run(root, name, "--method", "triforce", "--offload", "on", *SMALL)
    assert out["tokens"] == hf_greedy[name] and out["stats"]["kv_offloaded_layers"] == 2


@pytest.mark.parametrize("name", ["mistral", "qwen2-yarn", "qwen3"])
def test_every_method_and_policy_equals_plain_decoding(loaded, name):
    prompt = loaded[name].tokenizer.encode(TEXT)
    kw = dict(max_new_tokens=N, temperature=0, ignore_eos=True)
    ar = tforce.generate(loaded[name], prompt, method="ar", **kw).tokens
    draft = loaded[DRAFT_OF[name]]
    runs = [("retrieval", "retrieval"), ("streaming", "retrieval"), ("naive", "retrieval")]
    runs += [("triforce", policy) for policy in POLICIES]
    for method, policy in runs:
        out = tforce.generate(loaded[name], prompt, draft=draft, method=method, policy=policy, rebuild_every=8,
                              **SMALL_KW, **kw)
        assert out.tokens == ar, (method, policy)


def _tp_worker(rank, world, root):
    """Each family loaded as this rank's slices: the logits of a prompt and greedy triforce tokens."""
    out = {}
    ids = random_ids(40, seed=3)
    for name in CHECKPOINTS:
        model = tforce.load_model(f"{root}/{name}", tokenizer=False, rank=rank, world=world).model
        draft = tforce.load_model(f"{root}/{DRAFT_OF[name]}", tokenizer=False).model
        attn = model.model.layers[0].self_attn
        out[name] = {"logits": forward(model, full_cache(model), ids), "q_rows": attn.q_proj.out_features,
                     "q_norm": tuple(attn.q_norm.weight.shape) if hasattr(attn.q_norm, "weight") else None,
                     "tokens": tforce.generate(model, ids[0].tolist(), draft=draft, method="triforce",
                                               max_new_tokens=N, temperature=0, ignore_eos=True,
                                               **SMALL_KW).tokens}
    return out


def test_tp2_shards_every_family(root, loaded):
    ranks = launch(_tp_worker, 2, "gloo", str(root), all_ranks=True)
    ids = random_ids(40, seed=3)
    for name in CHECKPOINTS:
        model = loaded[name].model
        whole = forward(model, full_cache(model), ids)
        ar = tforce.generate(model, ids[0].tolist(), method="ar", max_new_tokens=N, temperature=0,
                             ignore_eos=True).tokens
        for r in ranks:
            torch.testing.assert_close(r[name]["logits"], whole, atol=1e-4, rtol=0)
            assert r[name]["tokens"] == ar, name
            assert r[name]["q_rows"] == model.model.layers[0].self_attn.q_proj.out_features // 2
        assert ranks[0]["qwen3"]["q_norm"] == (32,)  # whole on every rank


def test_cli_tp2_equals_transformers_generate(root, hf_greedy):
    assert _run(root, "qwen3", "--method", "triforce", "--tp", "2", *SMALL)["tokens"] == hf_greedy["qwen3"]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_info_counts_the_checkpoint(root, loaded, name):
    r = CliRunner().invoke(app, ["info", "-m", str(root / name), "--json", "--dtype", "float32"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    model = loaded[name].model
    assert info["model"]["model_type"] == CHECKPOINTS[name][0] and info["model"]["head_dim"] == model.head_dim
    assert info["plan"]["weights_bytes"] == _tensor_bytes(root / name)
    assert info["model"]["rope_theta"] == 1e6
