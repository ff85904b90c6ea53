# tforce: `make demo` (the trained demo pair under models/, else a tiny RANDOM-weight pair; CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tforce-installed
MODELS := demo/models
BOOK := ../shared/data/books/great_expectations.txt

.PHONY: venv test demo demo-trained demo-random clean-demo

venv: $(STAMP)

# torch first and pinned: the CPU build lies on local disk; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q -n 2

$(MODELS)/tiny-target/config.json $(MODELS)/tiny-draft/config.json: | venv
	$(BIN)/python scripts/make_tiny.py demo

# The trained pair (scripts/train_demo.py, committed under models/) when present; else the random tiny pair.
TRAINED := models/demo-target
QUESTION := Question: what did the narrator call himself?

demo: venv
	@mkdir -p demo
	@if [ -f $(BOOK) ]; then \
		awk '/family name being Pirrip/{p=1} p{n+=length($$0)+1; print; if (n>2500 && /^$$/) exit}' $(BOOK) > demo/excerpt.txt; \
	else \
		printf '%s\n' "My father's family name being Pirrip, and my Christian name Philip," \
			"my infant tongue could make of both names nothing longer or more explicit" \
			"than Pip. So, I called myself Pip, and came to be called Pip." > demo/excerpt.txt; \
	fi
	@if [ -f $(TRAINED)/config.json ]; then $(MAKE) --no-print-directory demo-trained; \
	else $(MAKE) --no-print-directory demo-random; fi

demo-trained:
	@echo "=====================================================================" >&2
	@echo " tforce demo: the TRAINED demo pair (models/, see models/README.md):" >&2
	@echo " a 4.5M-parameter target and a 0.6M draft trained from scratch on a" >&2
	@echo " CPU in minutes on 43 novels. Small models: real English-like text," >&2
	@echo " little sense. The excerpt (Great Expectations) is a HELD-OUT book." >&2
	@echo " ar and triforce print the same tokens at --temperature 0; the" >&2
	@echo " acceptance rates on stderr are real. Timings on a CPU mean little." >&2
	@echo "=====================================================================" >&2
	@echo "--- method ar ---" >&2
	$(BIN)/tforce run demo/excerpt.txt -p "$(QUESTION)" \
		-m $(TRAINED) --draft models/demo-draft -n 64 --temperature 0 --method ar; echo
	@echo "--- method triforce ---" >&2
	$(BIN)/tforce run demo/excerpt.txt -p "$(QUESTION)" \
		-m $(TRAINED) --draft models/demo-draft -n 64 --temperature 0 --method triforce \
		--budget 256 --draft-budget 192 --sinks 4; echo

demo-random: $(MODELS)/tiny-target/config.json $(MODELS)/tiny-draft/config.json
	@echo "=====================================================================" >&2
	@echo " tforce demo: RANDOM WEIGHTS (scripts/make_tiny.py; the trained pair" >&2
	@echo " under models/ is missing). The text below is gibberish and the speed" >&2
	@echo " is not meaningful. What it shows: the CLI, and that triforce prints" >&2
	@echo " exactly the tokens plain decoding (ar) prints at --temperature 0." >&2
	@echo "=====================================================================" >&2
	@echo "--- method ar ---" >&2
	$(BIN)/tforce run demo/excerpt.txt -p "$(QUESTION)" \
		-m $(MODELS)/tiny-target --draft $(MODELS)/tiny-draft -n 64 --temperature 0 --method ar; echo
	@echo "--- method triforce ---" >&2
	$(BIN)/tforce run demo/excerpt.txt -p "$(QUESTION)" \
		-m $(MODELS)/tiny-target --draft $(MODELS)/tiny-draft -n 64 --temperature 0 --method triforce \
		--budget 64 --draft-budget 32 --sinks 4; echo

clean-demo:
	rm -rf demo
