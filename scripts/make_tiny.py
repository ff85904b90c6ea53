#!/usr/bin/env python
"""Write a RANDOM-WEIGHT demo pair (target + draft, byte tokenizer) for `make demo` and quick trials.

    python scripts/make_tiny.py [FOLDER]      # default: demo -> demo/models/tiny-target, demo/models/tiny-draft

The weights are random: generated text is gibberish and timings say nothing about real models. The
configs carry "tforce_synthetic": true, and `tforce info -m FOLDER` labels them RANDOM WEIGHTS. Both
models share the 259-token byte vocabulary, so the draft can draft for the target.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tforce.model.synthetic import make_checkpoint

TARGET = dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=16384)  # the demo excerpt is ~11.4K byte-level tokens
DRAFT = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=16384)  # the demo excerpt is ~11.4K byte-level tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", nargs="?", default="demo", help="writes FOLDER/models/tiny-{target,draft}")
    ap.add_argument("--force", action="store_true", help="overwrite an existing pair")
    args = ap.parse_args(argv)
    models = Path(args.folder) / "models"
    for name, arch, seed in (("tiny-target", TARGET, 0), ("tiny-draft", DRAFT, 1)):
        path = models / name
        if (path / "config.json").is_file() and not args.force:
            print(f"make_tiny: {path} exists (use --force to rewrite)", file=sys.stderr)
            continue
        make_checkpoint(path, seed=seed, **arch)
        print(f"make_tiny: wrote {path} (RANDOM WEIGHTS: text will be gibberish)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
