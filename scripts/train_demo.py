#!/usr/bin/env python
"""Train tforce's demo pair (a long-context target and a small draft sharing one tokenizer) from scratch.

    python scripts/train_demo.py --config cpu                  # ~13 minutes on 2 CPU cores
    python scripts/train_demo.py --config gpu --minutes 6      # one H100, bf16 autocast
    python scripts/train_demo.py --config tiny --out /tmp/x    # seconds; for tests

Data: the public-domain novels in ../shared/data/books/train/ (paths relative to the repo root). The
six books directly under ../shared/data/books/ are held out entirely: they never reach the tokenizer
or the models, and the held-out perplexity and passkey accuracy are measured on them.

Writes OUT/demo-target and OUT/demo-draft (config.json, fp16 model.safetensors, tokenizer files), and
OUT/card.json + OUT/README.md with the data, sizes, steps, wall time, final training loss, held-out
perplexity and the target's passkey accuracy by context length. The target's training stream mixes in
passkey examples from tforce.text.needle (the same prompts the evaluation uses, on other books). Training
runs until --minutes are used, the step count re-estimated from the recent pace every 25 steps (or
for exactly --steps steps: with --steps and --seed, a run is reproducible on the same software).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from tforce.text.needle import needle_prompt, random_key

ROOT = Path(__file__).resolve().parent.parent
BOOKS = ROOT.parent / "shared" / "data" / "books"


@dataclass(frozen=True)
class Arch:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    seq_len: int
    batch: int
    lr: float
    tie: bool = False
    rope_theta: float = 10000.0


@dataclass(frozen=True)
class Long:
    """Context extension of the trained target, as long-context models are extended in practice: RoPE
    rescaled (transformers' rope_parameters, e.g. YaRN; tforce.cache.rope reads the same) from the base's
    training length to `seq_len`, then a short phase on `seq_len`-token sequences, a fraction
    `passkey_frac` of them packed passkey episodes (lengths log-uniform from `min_episode`), the rest book
    text."""
    seq_len: int
    batch: int
    lr: float
    share: float              # fraction of the target's budget when training from scratch (--extend: all)
    rope_type: str = "yarn"
    passkey_frac: float = 0.6
    min_episode: int = 256


@dataclass(frozen=True)
class Setup:
    vocab: int
    target: Arch
    draft: Arch
    minutes: float            # total budget for training both models (tokenizer and evaluation extra)
    draft_share: float        # fraction of the training budget given to the draft
    passkey_frac: float       # fraction of target sequences that carry passkey examples (phase 1)
    answer_weight: float      # loss weight of the passkey answer tokens
    eval_tokens: int          # held-out tokens per book for perplexity
    passkey_lengths: tuple = (256, 512, 1024, 2048)
    passkey_prompts: int = 20
    tokenizer_chars: int = 40_000_000
    train_chars: int = 10 ** 9  # training text pool, a random slice of each book (CPU: a few passes' worth)
    steps: int | None = None  # fixed step count for the target (draft: scaled); None: from --minutes
    # Phase 2 of the target: this share of its budget on sequences made only of packed passkey episodes,
    # (seq_len, batch) below. Many short episodes per step are what makes the copying (induction) circuit
    # form; with the episodes only a minority of phase 1's tokens, a CPU budget never got there.
    passkey_phase: float = 0.0
    passkey_shape: tuple = (512, 4)
    long: Long | None = None  # the context-extension phase of the target, after phases 1 and 2


CONFIGS = {
    "tiny": Setup(vocab=512,
                  target=Arch(64, 2, 2, 1, 172, 128, 2, 2e-3),
                  draft=Arch(32, 1, 2, 1, 86, 64, 2, 2e-3, tie=True),
                  minutes=0.05, draft_share=0.3, passkey_frac=0.5, answer_weight=4.0, eval_tokens=256,
                  passkey_lengths=(64, 96), passkey_prompts=2, tokenizer_chars=300_000, steps=3,
                  passkey_phase=0.4, passkey_shape=(96, 2),
                  long=Long(seq_len=256, batch=1, lr=1e-3, share=0.3, min_episode=64)),
    "cpu": Setup(vocab=4096,
                 target=Arch(256, 4, 4, 2, 512, 1024, 2, 2e-3, rope_theta=10000.0),
                 draft=Arch(96, 2, 2, 1, 256, 256, 8, 3e-3, tie=True),
                 minutes=11.0, draft_share=0.18, passkey_frac=0.5, answer_weight=12.0, eval_tokens=8192,
                 passkey_lengths=(256, 512, 1024, 2048, 4096), tokenizer_chars=12_000_000,
                 train_chars=10_000_000, passkey_phase=0.5, passkey_shape=(512, 4),
                 long=Long(seq_len=4096, batch=1, lr=3e-4, share=0.4)),
    "gpu": Setup(vocab=8192,
                 # 18.9M parameters (37.8 MB in fp16) beside a 1.6M draft: the pair comes back from a device
                 # call in 15 MiB parts within its 64 MiB (scripts/gpu_train.sh; tests/scripts/test_train_demo.py)
                 target=Arch(384, 8, 6, 2, 1024, 8192, 8, 1e-3, rope_theta=500000.0),
                 draft=Arch(128, 2, 4, 2, 344, 512, 64, 3e-3, tie=True),
                 minutes=8.0, draft_share=0.15, passkey_frac=0.4, answer_weight=12.0, eval_tokens=32768,
                 passkey_lengths=(1024, 4096, 8192, 16384, 32768), passkey_phase=0.3, passkey_shape=(2048, 16),
                 long=Long(seq_len=32768, batch=2, lr=5e-4, share=0.3, min_episode=1024)),
}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- data

def clean(text: str) -> str:
    """The book without Project Gutenberg's header and licence."""
    start = re.search(r"\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG[^\n]*\n", text)
    end = re.search(r"\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG", text)
    return text[start.end() if start else 0:end.start() if end else len(text)].strip()


def read_books(folder: Path) -> dict[str, str]:
    return {p.stem: clean(p.read_text(encoding="utf-8", errors="replace")) for p in sorted(folder.glob("*.txt"))}


def train_tokenizer(texts: list[str], vocab: int, max_chars: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    # digits one per token: passkeys are copied digit by digit, whatever the number
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    per_book = max_chars // max(len(texts), 1)
    tok.train_from_iterator([t[:per_book] for t in texts], trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class Stream:
    """Random training windows from the tokenized books; the target's carry passkey examples."""

    def __init__(self, tok, books: dict[str, str], ids: dict[str, torch.Tensor], rng: random.Random,
                 passkey_frac: float = 0.0, min_episode: int = 48):
        self.tok, self.books, self.ids, self.rng, self.passkey_frac = tok, books, ids, rng, passkey_frac
        self.min_episode = min_episode
        self.names = list(ids)
        self.weights = [len(ids[n]) for n in self.names]

    def window(self, n: int) -> list[int]:
        name = self.rng.choices(self.names, self.weights)[0]
        ids = self.ids[name]
        start = self.rng.randrange(0, max(len(ids) - n, 1))
        return ids[start:start + n].tolist()

    def passkey(self, max_len: int) -> tuple[list[int], int, int]:
        """(ids, answer_start, answer_end): needle prompt + answer + eos, of random length <= max_len.

        Lengths are log-uniform from `min_episode` tokens: mostly short episodes (many answers per step),
        some long."""
        lo = min(self.min_episode, max_len // 2)
        length = int(math.exp(self.rng.uniform(math.log(lo), math.log(max(lo, max_len - 8)))))
        name = self.rng.choices(self.names, self.weights)[0]
        text = self.books[name]
        n_chars = length * 6 + 200
        at = self.rng.randrange(0, max(len(text) - n_chars, 1))
        key = random_key(self.rng, self.rng.choice((4, 5, 5, 6)))
        prompt, answer = needle_prompt(self.tok, text[at:at + n_chars], length, self.rng.random(), key,
                                       seed=self.rng.randrange(1 << 30))
        return prompt + answer + [self.tok.eos_token_id], len(prompt), len(prompt) + len(answer)

    def batch(self, batch: int, seq_len: int, answer_weight: float):
        """x, y (batch, seq_len) and per-token loss weights (answer tokens weigh more)."""
        xs, ws = [], []
        for _ in range(batch):
            w = [1.0] * (seq_len + 1)
            seq: list[int] = []
            if self.rng.random() < self.passkey_frac:  # passkey episodes, packed: more answers per step
                while len(seq) < seq_len - 64:
                    try:
                        ids, a, b = self.passkey(seq_len - len(seq))
                    except ValueError:  # filler too short (end of a book) or no room left: plain text
                        break
                    for i in range(len(seq) + a, len(seq) + b):
                        w[i] = answer_weight
                    seq += ids
            if len(seq) < seq_len + 1:
                seq = seq + [self.tok.bos_token_id] + self.window(seq_len + 1)
            xs.append(seq[:seq_len + 1])
            ws.append(w)
        t, w = torch.tensor(xs), torch.tensor(ws)
        return t[:, :-1], t[:, 1:], w[:, 1:]


# ---------------------------------------------------------------- models

def build(arch: Arch, vocab: int, tok, max_pos: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=arch.hidden, intermediate_size=arch.intermediate,
                      num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
                      num_key_value_heads=arch.kv_heads, max_position_embeddings=max_pos,
                      rope_theta=arch.rope_theta, tie_word_embeddings=arch.tie, rms_norm_eps=1e-5,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=None, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def extend_context(model, long: Long):
    """The model with RoPE rescaled from its max_position_embeddings to long.seq_len (same weights)."""
    from transformers import LlamaForCausalLM

    cfg = model.config
    base = cfg.max_position_embeddings
    theta = (cfg.rope_parameters or {}).get("rope_theta", 10000.0)
    cfg.rope_parameters = {"rope_type": long.rope_type, "factor": long.seq_len / base, "rope_theta": theta,
                           "original_max_position_embeddings": base}
    cfg.max_position_embeddings = long.seq_len
    new = LlamaForCausalLM(cfg)
    new.load_state_dict(model.state_dict())  # the rotary frequencies are buffers outside the state dict
    return new.to(next(model.parameters()).dtype)


def lr_at(step: int, total: int, peak: float) -> float:
    warm = max(1, min(100, total // 10))
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def train(name: str, model, stream: Stream, arch: Arch, seconds: float, steps: int | None,
          answer_weight: float, device: str, log_every: int = 25) -> dict:
    """Train to a step count fixed from the first steps' timing (or `steps`); returns the record."""
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=arch.lr, betas=(0.9, 0.95), fused=device.startswith("cuda") or None)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else _null()
    t0, total, step, losses = time.perf_counter(), steps, 0, []
    t_mark, s_mark = t0, 0
    probe = 3
    while total is None or step < total:
        x, y, w = (t.to(device) for t in stream.batch(arch.batch, arch.seq_len, answer_weight))
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total or 10 ** 9, arch.lr)
        with autocast:
            logits = model(input_ids=x).logits
        ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        loss = (ce * w.reshape(-1)).sum() / w.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(ce.mean().item())  # the plain LM loss (unweighted), what the card reports
        step += 1
        if steps is None and (step == probe or step % log_every == 0):
            # size the run to the time left at the recent pace (a shared machine's load changes); the
            # cosine schedule follows the new total. --steps fixes it instead, for a reproducible run.
            now = time.perf_counter()
            per = (now - t_mark) / (step - s_mark) if step > probe else (now - t0) / probe
            total = max(step + 1, step + int((seconds - (now - t0)) / per))
            if step == probe:  # later estimates: the pace since the probe (steadier than the last 25 steps)
                t_mark, s_mark = now, step
            if step == probe:
                log(f"{name}: {per:.2f} s/step, {arch.batch * arch.seq_len / per:.0f} tokens/s -> {total} steps")
        if step % log_every == 0 or step == total:
            log(f"{name}: step {step}/{total} loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.3f} "
                f"lr {opt.param_groups[0]['lr']:.2e} {time.perf_counter() - t0:.0f} s "
                f"({arch.batch * arch.seq_len * step / (time.perf_counter() - t0):.0f} tokens/s)")
    wall = time.perf_counter() - t0
    tail = losses[-max(1, min(50, len(losses) // 5)):]
    model.eval()
    return {"steps": step, "batch": arch.batch, "seq_len": arch.seq_len, "tokens": step * arch.batch * arch.seq_len,
            "wall_s": round(wall, 1), "tokens_per_s": round(step * arch.batch * arch.seq_len / wall),
            "final_loss": round(sum(tail) / len(tail), 4), "peak_lr": arch.lr}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


# ---------------------------------------------------------------- evaluation

@torch.no_grad()
def perplexity(model, ids: dict[str, torch.Tensor], seq_len: int, n_tokens: int, device: str) -> dict:
    """Per held-out book: exp(mean loss) over the first n_tokens of its text, in seq_len windows."""
    out = {}
    for name, t in ids.items():
        t = t[:n_tokens + 1]
        total, count = 0.0, 0
        for s in range(0, len(t) - 1, seq_len):
            x = t[s:s + seq_len + 1].long().to(device)
            if len(x) < 2:
                break
            logits = model(input_ids=x[None, :-1]).logits.float()[0]
            total += F.cross_entropy(logits, x[1:], reduction="sum").item()
            count += len(x) - 1
        out[name] = round(math.exp(total / count), 2)
    out["all"] = round(math.exp(sum(math.log(v) for v in out.values()) / len(out)), 2)  # geometric mean
    return out


@torch.no_grad()
def passkey_accuracy(model, tok, books: dict[str, str], lengths, n: int, seed: int, device: str,
                     bins: int = 5) -> tuple[dict, dict]:
    """Greedy exact match of the key after needle prompts built from the held-out books: accuracy by
    prompt length, and by length and depth (`bins` equal depth ranges; prompt i sits at (i + 0.5) / n)."""
    rng, names, out, by_depth = random.Random(seed), list(books), {}, {}
    bins = min(bins, n)
    for length in lengths:
        hits = [[] for _ in range(bins)]
        for i in range(n):
            text = books[names[i % len(names)]]
            at = rng.randrange(0, len(text) - length * 8)
            key = random_key(rng, 5)
            depth = (i + 0.5) / n
            prompt, answer = needle_prompt(tok, text[at:at + length * 8], length, depth, key, seed=i)
            ids = torch.tensor([prompt], device=device)
            got = model.generate(ids, max_new_tokens=len(answer), do_sample=False,
                                 attention_mask=torch.ones_like(ids), pad_token_id=tok.eos_token_id)
            hits[int(depth * bins)].append(got[0, len(prompt):].tolist() == answer)
        out[str(length)] = sum(map(sum, hits)) / n
        by_depth[str(length)] = {f"{b / bins:.1f}-{(b + 1) / bins:.1f}": round(sum(h) / len(h), 3)
                                 for b, h in enumerate(hits)}
    return out, by_depth


# ---------------------------------------------------------------- main

def save(model, tok, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(path, safe_serialization=True, max_shard_size="15MB")
    tok.save_pretrained(path)
    model.float()


def card_markdown(card: dict) -> str:
    t, d = card["target"], card["draft"]
    pk = ", ".join(f"{k}: {v:.0%}" for k, v in t["passkey_accuracy"].items())
    p2, lt, base = t.get("passkey_train"), t.get("long_train"), card.get("base")
    phase2 = (f" {p2['steps']} steps ({p2['tokens']:,} tokens, {p2['wall_s']:.0f} s, final loss "
              f"{p2['final_loss']:.3f}) on {p2['seq_len']}-token sequences made only of packed passkey episodes "
              f"(peak learning rate {p2['peak_lr']:g}): the phase that forms the copying circuit;" if p2
              else " nothing else;")
    first = base.get("base") if base else None  # a continued long phase: the pair's first two runs
    origin = (f"Trained from scratch by `{first['command']}` (seed {first['seed']}) on {first['device']}, in "
              f"{first['wall_s'] / 60:.1f} minutes in all; the target's context extended by `{base['command']}` "
              f"(seed {base['seed']}) on {base['device']}, in {base['wall_s'] / 60:.1f} minutes in all; then its long "
              f"phase continued by `{card['command']}` on {card['device']}, in {card['wall_s'] / 60:.1f} minutes in all"
              if first else
              f"Trained from scratch by `{base['command']}` (seed {base['seed']}) on {base['device']}, in "
              f"{base['wall_s'] / 60:.1f} minutes in all; then the target's "
              f"{'long phase continued' if t.get('long_train_more') else 'context extended'} by `{card['command']}` "
              f"(seed {card['seed']}) on {card['device']}, in {card['wall_s'] / 60:.1f} minutes in all" if base else
              f"Trained from scratch by `{card['command']}` (seed {card['seed']}) on {card['device']}, in "
              f"{card['wall_s'] / 60:.1f} minutes in all")
    long = ""
    if lt:
        r = lt["rope"]
        long = f"""
**Long-context phase** (as long-context models are extended in practice): the target's RoPE rescaled
with {r['rope_type']} (`rope_parameters` {json.dumps(r)} in its config.json, which
transformers and `tforce.cache.rope` both read), from {r['original_max_position_embeddings']} to
{t['max_position_embeddings']} positions, then {lt['steps']} steps ({lt['tokens']:,} tokens, {lt['wall_s']:.0f} s,
{lt['tokens_per_s']:,} tokens/s, final loss {lt['final_loss']:.3f}, peak learning rate {lt['peak_lr']:g}) on
{lt['seq_len']}-token sequences x {lt['batch']}: a fraction {lt['passkey_frac']} of them packed passkey episodes
(lengths log-uniform from {lt['min_episode']} tokens), the rest book text. The draft is not trained
again: its StreamingLLM cache keeps its positions within its window; its max_position_embeddings says
the target's context.
"""
    lm = t.get("long_train_more")
    if lm:
        before = ", ".join(f"{k}: {v:.0%}" for k, v in t["passkey_before_more"].items())
        long += f"""
**Long phase, continued**: {lm['steps']} more steps ({lm['tokens']:,} tokens, {lm['wall_s']:.0f} s,
{lm['tokens_per_s']:,} tokens/s, final loss {lm['final_loss']:.3f}, peak learning rate {lm['peak_lr']:g}) on
{lm['seq_len']}-token sequences x {lm['batch']}, a fraction {lm['passkey_frac']} of them packed passkey episodes of
lengths log-uniform from {lm['min_episode']} tokens (long-range retrieval, where the first phase's short episodes
left the key lost). Before it: held-out perplexity {t['perplexity_before_more']['all']}, pass key {before}.
"""
    ppl_rows = ""
    if "perplexity_before_long" in t:
        ppl_rows = (f"\n| held-out perplexity, {lt['rope']['original_max_position_embeddings']}-token windows: "
                    f"before / after the long phase | {t['perplexity_before_long']['all']} / "
                    f"{t['perplexity_at_base_len']['all']} | |")
    steps = f"{t['train']['steps']} ({t['train']['tokens']:,})"
    steps += f" + passkey phase {p2['steps']} ({p2['tokens']:,})" if p2 else ""
    steps += f" + long phase {lt['steps']} ({lt['tokens']:,})" if lt else ""
    steps += f" + {lm['steps']} ({lm['tokens']:,})" if lm else ""
    wall = t['train']['wall_s'] + (p2['wall_s'] if p2 else 0) + (lt['wall_s'] if lt else 0) + (lm['wall_s'] if lm else 0)
    depths = next(iter(t.get("passkey_by_depth", {}).values()), {})
    by_depth = "" if not depths else (
        "\n| prompt tokens | " + " | ".join(f"depth {k}" for k in depths) + " | all |\n|" + " --- |" * (len(depths) + 2)
        + "".join(f"\n| {n} | " + " | ".join(f"{v:.0%}" for v in row.values()) + f" | {t['passkey_accuracy'][n]:.0%} |"
                  for n, row in t["passkey_by_depth"].items()) + "\n")
    return f"""# tforce demo pair ({card['config']} config)

{origin}. Small models: the text they write is locally fluent, period-novel
English without much sense; what they show is real text and real acceptance rates for `tforce run`.

**Data.** Tokenizer and both models: the {len(card['data']['train_books'])} public-domain novels in
`../shared/data/books/train/` (Project Gutenberg headers and licences removed;
{card['data']['train_tokens']:,} tokens). **Held out entirely** (never seen by the tokenizer or the models):
{', '.join(card['data']['held_out_books'])} (`../shared/data/books/*.txt`). The {'base ' if lt else ''}target trains in two
phases: first a fraction {card['passkey_frac']} of its sequences are packed passkey examples from
`tforce.text.needle` ("The pass key is KEY. Remember it." at a random depth of a novel excerpt, then "What is
the pass key? The pass key is KEY"; episode lengths log-uniform from 48 tokens; answer tokens weigh
{card['answer_weight']:g}x in the loss), the rest plain book text; then{phase2} evaluation uses the same phrasing on
the held-out books. The training loss reported is the plain mean over all tokens.
{long}
**Tokenizer.** Byte-level BPE, {card['vocab']} ids, digits one per token; `<s>` (bos, prepended),
`</s>` (eos), `<unk>`.

| | target (`demo-target`) | draft (`demo-draft`) |
| --- | --- | --- |
| parameters | {t['params'] / 1e6:.2f} M | {d['params'] / 1e6:.2f} M |
| shape | {t['arch']['layers']} layers, hidden {t['arch']['hidden']}, {t['arch']['heads']} heads / {t['arch']['kv_heads']} KV heads, rope_theta {t['arch']['rope_theta']:g} | {d['arch']['layers']} layers, hidden {d['arch']['hidden']}, {d['arch']['heads']} heads / {d['arch']['kv_heads']} KV heads, tied embeddings |
| training sequences | {t['train']['seq_len']} tokens x {t['train']['batch']}{f"; long phase {lt['seq_len']} x {lt['batch']}" if lt else ""} | {d['train']['seq_len']} tokens x {d['train']['batch']} |
| steps (tokens) | {steps} | {d['train']['steps']} ({d['train']['tokens']:,}) |
| training wall time | {wall:.0f} s ({t['train']['tokens_per_s']:,} tokens/s in phase 1) | {d['train']['wall_s']:.0f} s ({d['train']['tokens_per_s']:,} tokens/s) |
| final training loss (nats/token; target: phase 1) | {t['train']['final_loss']:.3f} | {d['train']['final_loss']:.3f} |
| held-out perplexity (geometric mean over books; windows of the training length: target {t['max_position_embeddings']}, draft {d['train']['seq_len']}) | {t['perplexity']['all']} | {d['perplexity']['all']} |{ppl_rows}
| max_position_embeddings | {t['max_position_embeddings']} | {d['max_position_embeddings']} |

Held-out perplexity per book (first {card['eval_tokens']:,} tokens of each, windows as in the table):
target {json.dumps({k: v for k, v in t['perplexity'].items() if k != 'all'})}; draft
{json.dumps({k: v for k, v in d['perplexity'].items() if k != 'all'})}.

**Passkey accuracy of the target** (greedy, exact match of the 5-digit key, {card['passkey_prompts']}
prompts per length from the held-out books, prompt i at depth (i + 0.5) / {card['passkey_prompts']}), by prompt length in
tokens: {pk}.
{by_depth}
Weights are stored in float16 (`model.safetensors`). All numbers come from `card.json`, written by the
training script itself.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="cpu")
    ap.add_argument("--out", default="models", help="writes OUT/demo-target, OUT/demo-draft, OUT/card.json")
    ap.add_argument("--minutes", type=float, help="training budget for both models (default: per config)")
    ap.add_argument("--steps", type=int, help="target steps (fixed; the draft gets a proportional count)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--extend", metavar="DIR", help="continue the pair in DIR (demo-target/, demo-draft/, card.json, "
                    "e.g. models): keep its tokenizer and draft, train only the target's long-context phase on "
                    "the whole --minutes budget")
    ap.add_argument("--books", default=str(BOOKS), help="folder with the held-out books and train/")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--min-episode", type=int, help="long phase: shortest passkey episode (default: per config)")
    ap.add_argument("--passkey-frac", type=float, help="long phase: fraction of passkey sequences (default: per config)")
    args = ap.parse_args(argv)
    setup = CONFIGS[args.config]
    if args.minutes is not None:
        setup = replace(setup, minutes=args.minutes, steps=None)
    if args.steps is not None:
        setup = replace(setup, steps=args.steps)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.perf_counter()
    out = Path(args.out)
    books = Path(args.books)

    train_books, held_books = read_books(books / "train"), read_books(books)
    if not train_books or not held_books:
        raise SystemExit(f"train_demo: no books under {books}/train and {books}")
    log(f"{len(train_books)} training books, {len(held_books)} held out: {', '.join(held_books)}")
    base = Path(args.extend) if args.extend else None
    if base:  # the pair to continue: its tokenizer, both models, and its card
        from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

        if not (base / "demo-target" / "config.json").is_file() or not (base / "card.json").is_file():
            raise SystemExit(f"train_demo: --extend {base} holds no demo-target/ and card.json")
        tok = PreTrainedTokenizerFast.from_pretrained(str(base / "demo-target"))
        target, draft = (LlamaForCausalLM.from_pretrained(str(base / f"demo-{n}"), dtype=torch.float32)
                         for n in ("target", "draft"))
        base_card = json.loads((base / "card.json").read_text())
    else:
        tok = train_tokenizer(list(train_books.values()), setup.vocab, setup.tokenizer_chars)
    vocab = len(tok)
    enc = lambda texts: {n: torch.tensor(e.ids, dtype=torch.int32)  # noqa: E731
                         for n, e in zip(texts, tok.backend_tokenizer.encode_batch(
                             list(texts.values()), add_special_tokens=False))}
    if args.config == "tiny":  # a slice of each book is plenty for a few steps
        train_books = {n: t[:20_000] for n, t in train_books.items()}
        held_books = {n: t[:20_000] for n, t in held_books.items()}
    per_book, pick = setup.train_chars // len(train_books), random.Random(args.seed)
    slices = {n: pick.randrange(0, max(len(t) - per_book, 1)) for n, t in train_books.items()}
    train_books = {n: t[slices[n]:slices[n] + per_book] for n, t in train_books.items()}
    train_ids, held_ids = enc(train_books), enc({n: t[:setup.eval_tokens * 8] for n, t in held_books.items()})
    n_train = sum(len(t) for t in train_ids.values())
    log(f"tokenizer: {vocab} ids; {n_train:,} training tokens ({time.perf_counter() - t_start:.0f} s)")

    budget = setup.minutes * 60
    long = setup.long
    context = long.seq_len if long else setup.target.seq_len  # the pair's max_position_embeddings
    rng = random.Random(args.seed)
    t_share = 1 - setup.draft_share
    long_share = 0.0 if long is None else 1.0 if base else long.share
    if base:
        rec = {n: {k: v for k, v in base_card[n].items() if k not in ("perplexity", "passkey_accuracy")}
               for n in ("target", "draft")}
        rec["draft"]["perplexity"] = base_card["draft"]["perplexity"]  # the draft is not trained again
        draft.config.max_position_embeddings = context  # its StreamingLLM cache keeps its positions small
        base_len = target.config.max_position_embeddings
        if long is None or base_len > long.seq_len:
            raise SystemExit(f"train_demo: the pair in {base} already has a context of {base_len} tokens; "
                             f"--config {args.config} extends to {long.seq_len if long else base_len}")
        more = base_len == long.seq_len  # already extended: continue its long phase at the same RoPE
    else:
        more = False
        target = build(setup.target, vocab, tok, setup.target.seq_len)
        draft = build(setup.draft, vocab, tok, context)  # usable at the target's length via StreamingLLM
        base_len = setup.target.seq_len
        t_steps = setup.steps
        rec = {}
        for name, model, arch, share, pk in (("target", target, setup.target, t_share * (1 - long_share),
                                              setup.passkey_frac),
                                             ("draft", draft, setup.draft, setup.draft_share, 0.0)):
            stream = Stream(tok, train_books, train_ids, random.Random(rng.randrange(1 << 30)), pk)
            n_params = sum(p.numel() for p in model.parameters())
            log(f"{name}: {n_params / 1e6:.2f} M parameters")
            phase2 = setup.passkey_phase if name == "target" else 0.0
            tr = train(name, model, stream, arch, budget * share * (1 - phase2), t_steps, setup.answer_weight,
                       args.device)
            rec[name] = {"params": n_params, "arch": asdict(arch), "train": tr}
            if phase2:
                seq_len, batch = setup.passkey_shape
                stream = Stream(tok, train_books, train_ids, random.Random(rng.randrange(1 << 30)), 1.0)
                rec[name]["passkey_train"] = train(
                    f"{name} (passkey phase)", model, stream,
                    replace(arch, seq_len=seq_len, batch=batch, lr=arch.lr / 2), budget * share * phase2,
                    None if t_steps is None else max(1, round(t_steps * phase2)), setup.answer_weight, args.device)
        rec["draft"]["perplexity"] = perplexity(draft, held_ids, setup.draft.seq_len, setup.eval_tokens, args.device)
    if long and (args.min_episode or args.passkey_frac is not None):
        long = replace(long, min_episode=args.min_episode or long.min_episode,
                       passkey_frac=long.passkey_frac if args.passkey_frac is None else args.passkey_frac)
    def long_phase(name: str, seconds: float, steps: int | None) -> dict:
        """Train the target on long.seq_len sequences (passkey episodes and book text); its record."""
        stream = Stream(tok, train_books, train_ids, random.Random(rng.randrange(1 << 30)), long.passkey_frac,
                        long.min_episode)
        arch = replace(setup.target, seq_len=long.seq_len, batch=long.batch, lr=long.lr)
        return dict(train(name, target, stream, arch, seconds, steps, setup.answer_weight, args.device),
                    passkey_frac=long.passkey_frac, min_episode=long.min_episode, rope=target.config.rope_parameters)

    if more:  # a second long phase: the first one's record stays, this one's is added beside it
        rec["target"]["perplexity_before_more"] = perplexity(target, held_ids, context, setup.eval_tokens,
                                                             args.device)
        rec["target"]["passkey_before_more"] = base_card["target"]["passkey_accuracy"]
        log(f"target: held-out perplexity before the second long phase {rec['target']['perplexity_before_more']}")
        rec["target"]["long_train_more"] = long_phase("target (long phase, continued)", budget, setup.steps)
    elif long:
        rec["target"]["perplexity_before_long"] = perplexity(target, held_ids, base_len, setup.eval_tokens,
                                                             args.device)
        log(f"target: held-out perplexity before the long phase {rec['target']['perplexity_before_long']}")
        target = extend_context(target, long)
        log(f"target: RoPE {target.config.rope_parameters}, max_position_embeddings {context}")
        rec["target"]["long_train"] = long_phase(
            "target (long phase)", budget * (t_share if not base else 1) * long_share,
            None if setup.steps is None else max(1, round(setup.steps * long_share)))
    for name, model in (("target", target), ("draft", draft)):
        rec[name]["max_position_embeddings"] = context
    t_eval = time.perf_counter()
    rec["target"]["perplexity"] = perplexity(target, held_ids, context, setup.eval_tokens, args.device)
    if long and not more:  # the same windows as before the extension, for comparison
        rec["target"]["perplexity_at_base_len"] = perplexity(target, held_ids, base_len, setup.eval_tokens,
                                                             args.device)
    for name in ("target", "draft"):
        log(f"{name}: held-out perplexity {rec[name]['perplexity']}")
    lengths = [n for n in setup.passkey_lengths if n <= context]
    acc, by_depth = passkey_accuracy(target, tok, held_books, lengths, setup.passkey_prompts, args.seed + 1,
                                     args.device)
    rec["target"]["passkey_accuracy"], rec["target"]["passkey_by_depth"] = acc, by_depth
    log(f"target: passkey accuracy {acc}, by depth {by_depth} (eval {time.perf_counter() - t_eval:.0f} s)")

    for name, model in (("target", target), ("draft", draft)):
        save(model.cpu(), tok, out / f"demo-{name}")
    card = {"config": args.config, "seed": args.seed,
            "command": "python scripts/train_demo.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "device": f"{args.device} ({torch.get_num_threads()} threads)" if args.device == "cpu"
            else torch.cuda.get_device_name(), "torch": torch.__version__,
            "vocab": vocab, "passkey_frac": setup.passkey_frac, "answer_weight": setup.answer_weight,
            "passkey_phase": setup.passkey_phase,
            "eval_tokens": setup.eval_tokens, "passkey_prompts": setup.passkey_prompts,
            "base": None if not base else {k: base_card.get(k) for k in ("command", "seed", "device", "wall_s", "base")},
            "data": {"train_books": sorted(train_books), "held_out_books": sorted(held_books),
                     "train_tokens": n_train},
            "target": rec["target"], "draft": rec["draft"],
            "wall_s": round(time.perf_counter() - t_start, 1)}
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "README.md").write_text(card_markdown(card))
    log(f"wrote {out}/demo-target, {out}/demo-draft, {out}/card.json, {out}/README.md "
        f"({card['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
