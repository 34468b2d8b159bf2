# Two commands do everything on a fresh clone:
#   make run   - set up, fetch the default model if missing, start the streaming terminal chat
#   make test  - set up and run the test suite (CPU only; GPU tests: make test-gpu)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: run test test-slow test-gpu lint bench setup

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# CPU build of torch from local disk; GPU users install their own CUDA torch first.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/edgeinfer pull
	$(VENV)/bin/edgeinfer chat

test: $(STAMP)
	$(VENV)/bin/edgeinfer pull
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu

bench: $(STAMP)
	$(PY) tools/bench_cpu.py
