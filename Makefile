# Every target uses .venv at the repo root. The demo needs only the dev extra; the tests also install
# the integrations extra (TRL, verl, Ray), so the framework tests run against the real packages.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
INTEGRATIONS_STAMP := $(VENV)/.installed-integrations

.PHONY: demo test lint bench clean test-torchmetrics-range

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

# The packed sync writes torchmetrics' private states: run the sync/DDP tests against the lowest and the newest
# torchmetrics that pyproject.toml allows, each in a throwaway venv under /tmp (torch pinned by constraints.txt).
TORCHMETRICS_LOWEST := 1.4.0
# The one gloo run of every metric and collection (test_contracts' ddp tests), the trust checks over ranks, and the
# state merges and round trips (merge_state folds with torchmetrics' _reduce_states: its merge_state came in 1.5),
# the collection's reset (reset_states does what torchmetrics' Metric.reset does, with one copy) and its update (the
# fold does what torchmetrics' update wrapper does: _computed, _update_count, _enable_grad, compute_on_cpu), and a
# refused forward (it restores torchmetrics' copy of the window and its sync settings).
SYNC_TESTS := tests/test_contracts.py tests/test_trust_ddp.py tests/test_trust_properties.py \
	tests/test_standalone_input_checks.py -k "ddp or merge or round_trip or any_sequence or reset or fold or refused_forward"
test-torchmetrics-range:
	set -e; for spec in "torchmetrics==$(TORCHMETRICS_LOWEST)" "torchmetrics"; do \
	  env=$$(mktemp -d /tmp/opbc-torchmetrics-XXXXXX); \
	  $(PY) -m venv $$env; \
	  $$env/bin/python -m pip install -q -c constraints.txt --upgrade "$$spec" torch numpy tqdm pytest pytest-timeout hypothesis; \
	  echo "== $$($$env/bin/python -c 'import torchmetrics; print("torchmetrics", torchmetrics.__version__)')"; \
	  $$env/bin/python -m pytest -q -p no:cacheprovider $(SYNC_TESTS) || { rm -rf $$env; exit 1; }; \
	  rm -rf $$env; \
	done

lint: $(STAMP)
	$(BIN)/python -m ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench.py

clean:
	rm -rf $(VENV) build *.egg-info
