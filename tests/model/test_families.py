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
from tforce.errors import UsageError
from tforce.bench.peers import no_eos
from tforce.engine.placement import weight_bytes
from tforce.parallel.ranks import launch
from tforce.cache.rope import Rotary
from tforce.model.synthetic import make_family_checkpoint
from tforce.model.weights import read_config

from cli_helpers import one_error_line
from exactness_helpers import PROMPT as SMALL_PROMPT, N_TOKENS, SAMPLES, V, check, draw, exact_joint

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
    files = [safe_open(str(f), framework="pt") for f in path.glob("*.safetensors")]
    return sum(sf.get_tensor(k).nbytes for sf in files for k in sf.keys())


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


def test_qwen3_head_size_need_not_divide_the_hidden_size(tmp_path):
    """5 heads of 16 over a hidden size of 48: refused for a Llama (hidden / heads), read for a Qwen3."""
    path = make_family_checkpoint(tmp_path / "odd", "qwen3", hidden_size=48, num_attention_heads=5,
                                  num_key_value_heads=1, head_dim=16)
    ids = random_ids(20)
    model = tforce.load_model(str(path)).model
    with torch.no_grad():
        ref = hf_model(path)(ids).logits
    torch.testing.assert_close(forward(model, full_cache(model), ids), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name, remove", [("qwen2", "bias"), ("qwen3", "q_norm"), ("qwen2-yarn", "yarn")])
def test_a_missing_difference_changes_the_logits(root, loaded, name, remove):
    """The comparison above can fail: without the q/k/v biases, the q/k norms or YaRN, the logits move."""
    model = loaded[name].model
    ids = random_ids(40, seed=3)
    ref = forward(model, full_cache(model), ids)
    if remove == "yarn":
        cache = full_cache(model, rotary=Rotary(read_config(root / "qwen2"), 128))  # same theta, no YaRN
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
@pytest.mark.parametrize("method", ["ar", "triforce", "triforce --deterministic"])
def test_cli_greedy_equals_transformers_generate(root, hf_greedy, name, method):
    out = _run(root, name, "--method", *method.split(), *SMALL)
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
                     "bytes": sum({p.data_ptr(): p.nbytes for p in model.parameters()}.values()),
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
            assert r[name]["bytes"] == weight_bytes(model.config, 4, world=2)  # what the planner counts
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


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_chat_answers_as_plain_decoding(root, loaded, name):
    r = CliRunner().invoke(app, ["chat", "-m", str(root / name), "--draft", str(root / DRAFT_OF[name]),
                                 str(root / "doc.txt"), "--json", *SMALL, "-n", "8", "-t", "0"], input="Who?\n")
    assert r.exit_code == 0, (r.output, r.exception)
    [record] = [json.loads(line) for line in r.stdout.splitlines()]
    tok = loaded[name].tokenizer
    ids = tok.encode(TEXT) + tok.encode("\n\nWho?", add_special_tokens=False)
    assert record["tokens"] == tforce.generate(loaded[name], ids, method="ar", max_new_tokens=8, temperature=0).tokens


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_bench_and_transformers_peers(root, name):
    """bench's hf peers run transformers' own class of the family on our tensors: their greedy tokens match."""
    r = CliRunner().invoke(app, ["bench", "-m", str(root / name), "--draft", str(root / DRAFT_OF[name]), "--device",
                                 "cpu", "--prompt-len", "48", "--gen-len", "6", "--methods", "ar,triforce", "--budget",
                                 "16", "--chunk-size", "4", "--draft-budget", "32", "-t", "0", "--peers", "hf",
                                 "--json"])
    assert r.exit_code == 0, (r.output, r.exception)
    report = json.loads(r.stdout)
    assert [run["method"] for run in report["runs"]] == ["ar", "triforce"] and report["synthetic"] is False
    assert all(run["ms_per_token"] > 0 and run["tokens"] == 6 for run in report["runs"])
    ran = [p for p in report["peers"] if not p["skipped"]]
    assert {p["method"] for p in ran} == {"hf", "hf-assisted", "hf-lookup"}
    assert all(p["vs_ar"] == "match" for p in ran), ran


def test_snapshot_and_batch_on_qwen3(root, loaded, tmp_path):
    snap = str(tmp_path / "q3.kv")
    saved = _run(root, "qwen3", "--save-kv", snap, *SMALL)
    loaded_run = _run(root, "qwen3", "--load-kv", snap, *SMALL)
    assert loaded_run["tokens"] == saved["tokens"] and loaded_run["stats"]["kv_reused"] == saved["prompt_tokens"] - 1
    batch = tmp_path / "batch.jsonl"
    batch.write_text(json.dumps({"prompt": TEXT}) + "\n" + json.dumps({"prompt": "It was"}) + "\n")
    r = CliRunner().invoke(app, ["run", "-m", str(root / "qwen3"), "--draft", str(root / "qwen2"), "--batch",
                                 str(batch), "-t", "0", "-n", "8", "--ignore-eos", *SMALL])
    assert r.exit_code == 0, (r.output, r.exception)
    tok = loaded["qwen3"].tokenizer
    for line, text in zip(r.stdout.strip().splitlines(), [TEXT, "It was"]):
        expected = tforce.generate(loaded["qwen3"], tok.encode(text), method="ar", max_new_tokens=8, temperature=0,
                                   ignore_eos=True).tokens
        assert json.loads(line)["tokens"] == expected


def test_qwen3_sampling_matches_target_distribution(tmp_path):
    """Qwen3 target (q/k norms, head_dim 32), Qwen2 draft (biases), row-wise verification: the tokens
    triforce samples follow the target's exact distribution (test_exactness's chi-square)."""
    small = dict(vocab_size=V, max_position_embeddings=512)
    target = tforce.load_model(str(make_family_checkpoint(tmp_path / "t", "qwen3", seed=5, **small)),
                               tokenizer=False).model
    draft = tforce.load_model(str(make_family_checkpoint(tmp_path / "d", "qwen2", seed=6, **small)),
                              tokenizer=False).model
    joint = exact_joint(target, SMALL_PROMPT, N_TOKENS)
    samples, acc = draw(target, draft, SMALL_PROMPT, "triforce", SAMPLES, seed=4, deterministic=True)
    assert min(check(samples, joint)) > 1e-3
    assert 0.1 < acc < 0.95, acc


def _config_folder(root, tmp_path, name: str, **keys):
    """A folder holding qwen2's config.json with `keys` changed."""
    config = json.loads((root / "qwen2" / "config.json").read_text())
    config.update(keys)
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(config))
    return tmp_path / name


def test_sliding_window_refused_only_where_a_layer_slides(root, tmp_path):
    mistral = make_family_checkpoint(tmp_path / "mistral-v0.1", "mistral", sliding_window=4096,
                                     max_position_embeddings=32768)
    r = CliRunner().invoke(app, ["run", "-m", str(mistral), "-p", "hi", "--method", "ar"])
    one_error_line(r, 2, "sliding-window attention (4096 tokens, shorter than the 32768-token context)")
    short = dict(sliding_window=1024, max_position_embeddings=4096)
    for name, keys, refused in [("off", dict(use_sliding_window=False), False),  # Qwen2.5's own flag
                                ("on", dict(use_sliding_window=True, max_window_layers=0), True),
                                ("none-slide", dict(use_sliding_window=True, max_window_layers=2), False)]:
        folder = _config_folder(root, tmp_path, name, **short, **keys)
        if refused:
            with pytest.raises(UsageError, match="sliding-window attention"):
                read_config(folder)
        else:
            assert read_config(folder).model_type == "qwen2"
