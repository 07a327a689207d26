# Every target uses .venv at the repo root. The demo needs only the dev extra; the tests also install
# the integrations extra (TRL, verl, Ray), so the framework tests run against the real packages.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
INTEGRATIONS_STAMP := $(VENV)/.installed-integrations

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

$(INTEGRATIONS_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,integrations]"
	touch $(INTEGRATIONS_STAMP)

demo: $(STAMP)
	WANDB_MODE=offline $(BIN)/python examples/demo.py

test: $(INTEGRATIONS_STAMP)
	WANDB_MODE=offline HF_HUB_OFFLINE=1 $(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/python -m ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
