"""Chat templates on the byte tokenizer (tests/text/test_prompt_format.py, tests/text/test_template_date.py): Llama 3's
layout, the byte tokenizer with its special tokens and a template, and a tiny pair whose target carries one."""
from __future__ import annotations

from pathlib import Path

from tforce.model.synthetic import byte_tokenizer, make_checkpoint

from cli_helpers import DOC, DRAFT, TARGET

# Llama 3's layout (headers, a trimmed message, an end-of-turn token, the assistant's header last)
HEADERS = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n\n{{ m['content'] | trim }}<|eot|>{% endfor %}"
           "{% if add_generation_prompt %}<|assistant|>\n\n{% endif %}")


def tokenizer_with(template: str | None):
    """The byte tokenizer with the templates' four special tokens and `template` as its chat template."""
    tok = byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|eot|>", "<|user|>", "<|assistant|>", "<|system|>"]})
    tok.chat_template = template
    return tok


def templated_pair(root: Path, template: str, target: str = "chat-target", draft: str = "chat-draft") -> Path:
    """A tiny pair of 263 ids (the byte tokenizer's 259 and the template's four special tokens) in `root`,
    the target's tokenizer carrying `template`, and doc.txt."""
    make_checkpoint(root / target, seed=0, tokenizer=False, **{**TARGET, "vocab_size": 263})
    make_checkpoint(root / draft, seed=1, tokenizer=False, **{**DRAFT, "vocab_size": 263})
    tokenizer_with(template).save_pretrained(root / target)
    (root / "doc.txt").write_text(DOC)
    return root
