# `make run` starts the whole platform; `make test` runs the whole suite but vLLM's tests, which
# `make test-vllm` runs; `make check`, the inner loop, runs lint and every test but those that
# start the platform's processes or a browser. All install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed

.PHONY: install run test test-vllm check lint bench clean-var vllm

# Compiled modules are kept (in __pycache__, git-ignored) even where the environment says not to
# write them: the suite starts dozens of Python processes and collects ~90 test modules, and
# compiling the project's sources (and rewriting the tests' asserts) afresh in each costs seconds
# of CPU per run.
unexport PYTHONDONTWRITEBYTECODE

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q -r requirements.txt
	@touch $(STAMP)

install: $(STAMP)

run: install
	@bash scripts/run_platform.sh

# The whole suite but vLLM's, in two runs: the tests that start no process in two test processes,
# as `make check` runs them; then, one at a time, those that start the platform's processes or a
# browser (they share a session pool of workers, and wait on what crosses processes).
test: install lint
	@bash scripts/ensure_redis.sh
	@bash scripts/ensure_chromium.sh
	$(PY) -m pytest -m "not integration and not browser and not vllm" -n 2 --dist loadscope $(PYTEST_ARGS)
	$(PY) -m pytest -m "(integration or browser) and not vllm" $(PYTEST_ARGS)

# The tiers are markers the fixtures a test uses apply (tests/conftest.py). Two test processes,
# since the inner loop is CPU-bound and starts no worker process; a module's tests stay in one
# of them, so the engines its module-scoped fixtures load are loaded once.
check: install lint
	@bash scripts/ensure_redis.sh
	$(PY) -m pytest -m "not integration and not browser" -n 2 --dist loadscope $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/lint-imports

bench: install
	$(PY) bench/media.py
	$(PY) bench/prefix_cache.py
	$(PY) bench/routing.py
	$(PY) bench/models.py
	$(PY) bench/metrics.py

# The vLLM engine's own virtualenv (README: "Workers on vLLM"). PyPI's torchvision links CUDA
# libraries that the CPU torch lacks: torchaudio and torchcodec go (nothing here uses them) and
# deploy/vllm/sitecustomize.py lets torchvision's image code import without its compiled ops.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.requirements-installed

$(VLLM_STAMP): requirements-vllm.txt deploy/vllm/sitecustomize.py
	@test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --disable-pip-version-check -q -r requirements-vllm.txt
	$(VLLM_VENV)/bin/python -m pip uninstall --disable-pip-version-check -q -y torchaudio torchcodec
	cp deploy/vllm/sitecustomize.py "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	$(VLLM_VENV)/bin/python -c "import torchvision, vllm; from transformers import Qwen2VLImageProcessor"
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# vLLM's tests (marker `vllm`: tests/test_vllm_engine.py), which start vLLM engines from
# .venv-vllm (built first when missing). Apart from `make test`, which would not stay under 10
# minutes on 2 cores with them; CI runs both (README: "Workers on vLLM").
test-vllm: install vllm
	@bash scripts/ensure_redis.sh
	$(PY) -m pytest -m vllm $(PYTEST_ARGS)
