# kvcheck: the commands users, CI and benchmarks rely on.
#   make check   the main job on the reference target (prove, fuzz every kind, attention)
#   make test    the whole pytest suite, real vLLM targets included
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
FIND_LINKS := $(shell test -d /opt/wheels && echo --find-links /opt/wheels)
VLLM ?= 0.33.0
SGLANG ?= 0.5.23
TEST_VLLM := 0.25.1 0.33.0
EXAMPLES ?= 1000
NIGHTLY_MINUTES ?= 30

.PHONY: venv vllm vllms sglang check test prove attention fuzz lint bench nightly mutants gpu-check clean help

help:
	@echo "make check | test | prove | attention | lint | bench | nightly | mutants | gpu-check | vllm VLLM=X | sglang SGLANG=X"

$(VENV)/.stamp: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check $(FIND_LINKS) -r requirements.txt
	@touch $@

venv: $(VENV)/.stamp

vllm: venv
	bash scripts/install-vllm.sh $(VLLM)

sglang: venv
	bash scripts/install-sglang.sh $(SGLANG)

vllms: venv
	@for v in $(TEST_VLLM); do bash scripts/install-vllm.sh $$v || exit 1; done

check: venv
	./kvcheck check --examples $(EXAMPLES)

test: venv vllms sglang
	$(PY) -m pytest -q -n 2 tests

prove: venv
	./kvcheck prove

attention: venv
	$(PY) scripts/gpu_check.py --cpu-ok

lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff check --config impl/vllm/vllm-test-ruff.toml findings/kvcheck_utils.py findings/conftest.py $$(grep -l "^from kvcheck_utils import" findings/[0-9]*/test_*.py)
	$(VENV)/bin/ruff format --check --config impl/vllm/vllm-test-ruff.toml findings/kvcheck_utils.py findings/conftest.py $$(grep -l "^from kvcheck_utils import" findings/[0-9]*/test_*.py)

bench: venv vllms
	$(PY) -m bench

nightly: venv
	@for v in $$(./kvcheck nightly --releases); do bash scripts/install-vllm.sh $$v || exit 1; done
	NIGHTLY_MINUTES=$(NIGHTLY_MINUTES) ./kvcheck nightly

mutants: venv
	bash scripts/install-vllm.sh 0.33.0
	$(PY) scripts/mutants.py

gpu-check: venv
	$(PY) scripts/gpu_check.py

clean:
	rm -rf reports counterexamples .hypothesis
