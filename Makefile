# `make run` starts the whole platform; `make test` runs the whole suite. Both install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed

.PHONY: install run test lint bench clean-var

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	@touch $(STAMP)

install: $(STAMP)

run: install
	@bash scripts/run_platform.sh

test: install lint
	@bash scripts/ensure_redis.sh
	$(PY) -m pytest $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

bench: install
	$(PY) bench/media.py
	$(PY) bench/prefix_cache.py
	$(PY) bench/routing.py
	$(PY) bench/metrics.py
