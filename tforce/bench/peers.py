"""`tforce bench --peers hf`: the same prompt through transformers' own `generate`, on the same weights
(and `--peers llama.cpp`, llama.cpp's decode on the same GGUF file: llamacpp.py).

The question a user asks is "what do I gain over what I already have". Each peer is one way to decode
with stock transformers: `hf` (plain decoding), `hf-assisted` (assisted generation with tforce's draft
as `assistant_model`), `hf-lookup` (prompt lookup decoding) and `hf-offload` (transformers' offloaded
KV cache, CUDA only: on a CPU the cache already lives in host memory).

The peers run transformers' own class of the model's family (LlamaForCausalLM, Qwen2ForCausalLM, ...)
whose parameters are the very tensors of the loaded tforce model (no second copy, no rounding: the same
checkpoint or the same random weights), with `sdpa` attention, over the same token ids, the same number
of new tokens, EOS ignored, and the same sampling (greedy at temperature 0). Greedy outputs are compared
with tforce's `ar` token for token.

Timing: a warm-up generation per peer (WARMUP_TOKENS prompt tokens, 4 new) first, as for tforce's
methods. Then one gen_len-token generation per peer, timed inside: a streamer (`_Clock`) stamps each
batch of new tokens as generate hands it out, so `prefill_s` is the time to the first batch and
ms/token the time from it to the last over the tokens after it, decoding without the prefill, as
tforce's ms/token is. (Timing a 1-token run and subtracting it, as before, printed -29.4 ms/token at
7,500 prompt tokens on a CPU, where two prefills vary by seconds.) tokens/verification = new tokens /
the target's forward passes (the first, over the prompt, yields a token too): 1 for plain decoding, more
where drafted tokens are accepted.
"""
from __future__ import annotations

import copy
import gc
import time

import torch

from ..errors import TforceError, UsageError

FAMILIES = {"hf": ("hf", "hf-assisted", "hf-lookup", "hf-offload"), "llama.cpp": ("llama.cpp",)}
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value for prompt_lookup_num_tokens
ATTENTION = "sdpa"  # what transformers' from_pretrained picks by default


def parse_peers(text: str | None) -> tuple[str, ...]:
    """'' or None -> (); 'hf' -> the hf peers; 'llama.cpp' -> llama.cpp's llama-bench (llamacpp.py)."""
    names = tuple(dict.fromkeys(p.strip() for p in (text or "").split(",") if p.strip()))
    bad = [n for n in names if n not in FAMILIES]
    if bad or (text and not names):
        raise UsageError(f"--peers takes {', '.join(FAMILIES)} (hf: transformers' generate, plain, assisted by the "
                         f"draft, prompt lookup, offloaded cache; llama.cpp: llama-bench on the same GGUF); "
                         f"got {text!r}")
    return tuple(peer for n in names for peer in FAMILIES[n])


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def hf_model(model):
    """transformers' *ForCausalLM of `model`'s family whose parameters are `model`'s own tensors (shared, not
    copied).

    Built on the meta device and assigned, so no random initialisation runs; the rotary embedding holds
    buffers only (computed from the config), built for real on the model's device."""
    from ..model.families import hf_class

    config = copy.deepcopy(model.config)  # transformers writes into its config; ours stays as it was
    config._attn_implementation = ATTENTION
    with torch.device("meta"):
        hf = hf_class(config)(config)
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False, assign=True)
    if config.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
        missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise TforceError(f"transformers' {type(hf).__name__} does not take these weights (missing {missing[:3]}, "
                          f"unexpected {unexpected[:3]})")
    device = next(model.parameters()).device
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config).to(device)
    hf.generation_config = no_eos()
    return hf.eval()


def no_eos():
    """A generation config without EOS (generation runs to max_new_tokens, as tforce's ignore_eos).

    An empty list of EOS ids rather than None: prompt lookup decoding in transformers before 5.13 looks its
    drafted tokens up among the EOS ids without checking that there are any (torch.isin(ids, None): a
    TypeError). An empty list is no EOS to every version (no token is among them) and the lookup works."""
    from transformers import GenerationConfig

    return GenerationConfig(eos_token_id=[], pad_token_id=0)


def offload_available() -> bool:
    try:
        from transformers.generation.configuration_utils import ALL_CACHE_IMPLEMENTATIONS
    except ImportError:
        return False
    return "offloaded" in ALL_CACHE_IMPLEMENTATIONS


def skip_reason(peer: str, device: torch.device, has_draft: bool, quantized: bool = False) -> str | None:
    if quantized:
        return ("quantized projections (a GGUF's, kept so, or --weights int8/int4): transformers' class "
                "takes float ones; --weights float compares the same values")
    if peer == "hf-assisted" and not has_draft:
        return "no draft model (pass --draft)"
    if peer == "hf-offload" and device.type != "cuda":
        return "CPU run: the KV cache already lives in host memory (offloading is meaningless)"
    if peer == "hf-offload" and not offload_available():
        return f"transformers {transformers_version()} has no cache_implementation='offloaded'"
    return None


def peer_options(peer: str, assistant) -> dict:
    """generate()'s keyword arguments that make each peer what it is."""
    if peer == "hf-assisted":
        assistant.generation_config = no_eos()  # assisted generation adapts it during a call: start afresh
        return {"assistant_model": assistant}
    if peer == "hf-lookup":
        return {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
    if peer == "hf-offload":
        return {"cache_implementation": "offloaded"}
    return {}


def compare(tokens: list[int], reference: list[int] | None) -> str | None:
    """'match' or 'differ at token i' (0-based) against `reference`; None without one."""
    if reference is None:
        return None
    i = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), None)
    if i is None and len(tokens) != len(reference):
        i = min(len(tokens), len(reference))
    return "match" if i is None else f"differ at token {i}"


class Runner:
    """The peers of one bench: the target (and draft) as transformers models, one generate per call."""

    def __init__(self, target, draft, temperature: float, top_p: float, seed: int):
        self.target = hf_model(target)
        self.draft = hf_model(draft) if draft is not None else None
        self.device = next(target.parameters()).device
        self.seed = seed
        self.sampling = {"do_sample": False} if temperature == 0 else \
            {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}

    def generate(self, peer: str, ids: list[int], max_new: int) -> tuple[list[int], "_Clock", int]:
        """(new tokens, the clock of their arrival, the target's forward passes) of one generation."""
        x = torch.tensor([ids], device=self.device)
        torch.manual_seed(self.seed)
        options = dict(self.sampling, **peer_options(peer, self.draft))
        forwards = []
        hook = self.target.register_forward_pre_hook(lambda *_: forwards.append(1))
        clock = _Clock()
        try:
            _sync(self.device)
            clock.start = time.perf_counter()
            out = self.target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                       streamer=clock, **options)
        finally:
            hook.remove()
        return out[0, len(ids):].tolist(), clock, len(forwards)


class _Clock:
    """A transformers streamer that stamps each batch of new tokens as generate hands it out (its first
    put is the prompt). Streamers receive tokens on the host, so each stamp follows the device's work."""

    def __init__(self):
        self.start = 0.0
        self.stamps: list[tuple[float, int]] = []  # (seconds since start, new tokens in this batch)
        self._prompt = True

    def put(self, value: torch.Tensor) -> None:
        if self._prompt:
            self._prompt = False
            return
        self.stamps.append((time.perf_counter() - self.start, int(value.numel())))

    def end(self) -> None:
        pass

    def prefill_s(self) -> float | None:
        """Seconds to the first new token (the prompt's forward included)."""
        return self.stamps[0][0] if self.stamps else None

    def decode(self) -> tuple[float, int]:
        """(seconds, tokens) from the first batch of new tokens to the last: the tokens after the first batch."""
        if len(self.stamps) < 2:
            return 0.0, 0
        return self.stamps[-1][0] - self.stamps[0][0], sum(n for _, n in self.stamps[1:])


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(models, ids: list[int], cfg, ar_tokens: list[int] | None, warmup_tokens: int, progress=None,
        gguf=None) -> list[dict]:
    """One record per peer of cfg.peers (bench's JSON "peers"); the speed-up over ar is filled by bench.
    gguf: the model's GGUF file, which the llama.cpp peer reads (None: not a GGUF model)."""
    records = _hf_records(models, ids, cfg, ar_tokens, warmup_tokens, progress)
    if "llama.cpp" in cfg.peers:
        from . import llamacpp

        if progress:
            progress(f"llama.cpp: llama-bench at depth {len(ids)}, {cfg.gen_len} new tokens")
        records.append(llamacpp.record(gguf, models.device, len(ids), cfg.gen_len))
    return records


def _hf_records(models, ids: list[int], cfg, ar_tokens, warmup_tokens: int, progress) -> list[dict]:
    hf_peers = [p for p in cfg.peers if p in FAMILIES["hf"]]
    if not hf_peers:
        return []
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its deprecation notices about its own internal calls are not ours
    try:
        quantized = getattr(models.target, "weights", "auto") != "auto"
        skips = {p: skip_reason(p, models.device, models.draft is not None, quantized) for p in hf_peers}
        todo = [p for p in hf_peers if skips[p] is None]
        runner = Runner(models.target, models.draft, cfg.temperature, cfg.top_p, cfg.seed) if todo else None
        if progress:
            progress(f"peers: warm-up of {', '.join(todo) or 'none'} on the first {min(warmup_tokens, len(ids))} "
                     f"prompt tokens (not timed)")
        for peer in todo:
            _attempt(runner.generate, peer, ids[:warmup_tokens], 4)
        records = []
        for peer in hf_peers:
            if skips[peer] is None and progress:
                progress(f"{peer} (transformers {transformers_version()}): {len(ids)} prompt tokens, "
                         f"{cfg.gen_len} new tokens")
            records.append(_record(runner, peer, ids, cfg, ar_tokens, skips[peer]))
        return records
    finally:
        hf_logging.set_verbosity(verbosity)


def _attempt(fn, *args):
    """fn(*args), or the one-line reason transformers (or the device) refused it."""
    try:
        return fn(*args), None
    except (torch.cuda.OutOfMemoryError, RuntimeError, ValueError, NotImplementedError, TypeError) as e:
        # TypeError: how a transformers version's own bug in a decoding path shows (one peer fails, not the bench)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return None, f"failed: {type(e).__name__}: {first}"


def _record(runner: Runner, peer: str, ids: list[int], cfg, ar_tokens, skipped: str | None) -> dict:
    record = {"method": peer, "peer": f"transformers {transformers_version()}", "attention": ATTENTION,
              "tokens": 0, "ms_per_token": None, "speedup_vs_ar": None, "tokens_per_verification": None,
              "prefill_s": None, "decode_s": None, "gpu_mem_gib": None, "vs_ar": None, "skipped": skipped}
    if skipped:
        return record
    _free(runner.device)
    full, error = _attempt(runner.generate, peer, ids, cfg.gen_len)
    if error:
        record["skipped"] = error
        return record
    tokens, clock, forwards = full
    decode_s, decoded = clock.decode()
    record.update(tokens=len(tokens), prefill_s=clock.prefill_s(), decode_s=decode_s,
                  ms_per_token=1000 * decode_s / decoded if decoded else None,
                  tokens_per_verification=len(tokens) / forwards,
                  gpu_mem_gib=torch.cuda.max_memory_allocated(runner.device) / 2**30
                  if runner.device.type == "cuda" else None,
                  vs_ar=compare(tokens, ar_tokens) if cfg.temperature == 0 else None)
    return record


def _free(device: torch.device) -> None:
    """Drop what earlier generations left (tforce's caches included) and restart the peak-memory count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
