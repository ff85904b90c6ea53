# tforce: `make demo` (tiny RANDOM-weight pair, CPU) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.tforce-installed
MODELS := demo/models
BOOK := ../shared/data/books/great_expectations.txt

.PHONY: venv test demo clean-demo

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

demo: venv $(MODELS)/tiny-target/config.json $(MODELS)/tiny-draft/config.json
	@mkdir -p demo
	@if [ -f $(BOOK) ]; then \
		awk '/family name being Pirrip/{p=1} p&&/^$$/{b++; if (b==2) exit} p' $(BOOK) > demo/excerpt.txt; \
	else \
		printf '%s\n' "My father's family name being Pirrip, and my Christian name Philip," \
			"my infant tongue could make of both names nothing longer or more explicit" \
			"than Pip. So, I called myself Pip, and came to be called Pip." > demo/excerpt.txt; \
	fi
	@echo "=====================================================================" >&2
	@echo " tforce demo: RANDOM WEIGHTS (scripts/make_tiny.py). The text below is" >&2
	@echo " gibberish and the speed is not meaningful until the trained demo pair" >&2
	@echo " lands. What it shows: the CLI, and that triforce prints exactly the" >&2
	@echo " tokens plain decoding (ar) prints at --temperature 0." >&2
	@echo "=====================================================================" >&2
	@echo "--- method ar ---" >&2
	$(BIN)/tforce run demo/excerpt.txt -p "Question: what did the narrator call himself?" \
		-m $(MODELS)/tiny-target --draft $(MODELS)/tiny-draft -n 64 --temperature 0 --method ar; echo
	@echo "--- method triforce ---" >&2
	$(BIN)/tforce run demo/excerpt.txt -p "Question: what did the narrator call himself?" \
		-m $(MODELS)/tiny-target --draft $(MODELS)/tiny-draft -n 64 --temperature 0 --method triforce \
		--budget 64 --draft-budget 32 --sinks 4; echo

clean-demo:
	rm -rf demo
