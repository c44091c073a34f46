# `make run` starts the whole platform; `make test` runs the whole suite, vLLM's workers included;
# `make check`, the inner loop, runs lint and every test but those that start the platform's
# processes or a browser. All install first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.requirements-installed
# Test processes of the tier that starts no process (`make check`, below).
CHECK_PROCESSES ?= 3
# Test processes of the tier that starts the platform's processes (`make test`, below).
INTEGRATION_PROCESSES ?= 2

.PHONY: install run test test-vllm check lint bench clean-var vllm

# Compiled modules are kept (in __pycache__, git-ignored) even where the environment says not to
# write them: the suite starts dozens of Python processes and collects ~90 test modules, and
# compiling the project's sources (and rewriting the tests' asserts) afresh in each costs seconds
# of CPU per run.
unexport PYTHONDONTWRITEBYTECODE

# uv installs (from where pip is configured to look: scripts/uv_sources.py) in seconds what pip
# took a minute for; pip installs uv itself, at requirements.txt's pin.
UV := $(VENV)/bin/uv

$(STAMP): requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --disable-pip-version-check -q "$$(grep -o '^uv==[^ ]*' requirements.txt)"
	$(UV) pip install -q --python $(PY) $$($(PY) scripts/uv_sources.py) -r requirements.txt
	@touch $(STAMP)

install: $(STAMP)

run: install
	@bash scripts/run_platform.sh

# The whole suite in two runs: the tests that start no process in three test processes, as
# `make check` runs them; then those that start the platform's processes or a browser, in two
# test processes that each take whole groups of tests sharing a pool of workers, so that no pool
# starts twice (tests/process_groups.py; they mostly wait on what crosses processes), at nice 10,
# beside vLLM's (from .venv-vllm), one at a time, in a test run of their own: its output follows.
# The machine is then busy: at the same priority vLLM's run, a chain of engine starts, stretched
# to the integration tier's length (265 s); at nice 10 it keeps its pace and the two take 230 s
# (docs/decisions/2026-12-07-integration-tier-in-two-processes.md).
# (All three at once, the first at nice 10, saved ~50 s of the suite's ~275 s here, but on fresh
# clones `make check`'s tests that bound a wait by the clock, starved beside the others, failed 2
# runs in 3: docs/decisions/2026-12-07-test-runs-at-once.md.)
test: install lint vllm
	@bash scripts/ensure_redis.sh
	@bash scripts/ensure_chromium.sh
	$(PY) -m pytest -m "not integration and not browser" -n $(CHECK_PROCESSES) --dist loadscope $(PYTEST_ARGS)
	@bash scripts/side_by_side.sh '$(PY) -m pytest -m vllm $(PYTEST_ARGS)' \
		'nice -n 10 $(PY) -m pytest -m "(integration or browser) and not vllm" -n $(INTEGRATION_PROCESSES) --dist loadgroup $(PYTEST_ARGS)'

# The tiers are markers the fixtures a test uses apply (tests/conftest.py). A module's tests stay
# in one test process, so the engines its module-scoped fixtures load are loaded once. Three
# processes on two cores: a third of the tier's CPU sat idle with two, while tests waited out
# fault-injected timeouts and TTLs; with three it took 80-101 s against 96-104 s, the same CPU.
check: install lint
	@bash scripts/ensure_redis.sh
	$(PY) -m pytest -m "not integration and not browser" -n $(CHECK_PROCESSES) --dist loadscope $(PYTEST_ARGS)

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

# The vLLM engine's own virtualenv (README: "Workers on vLLM"), built by uv: ~35 s where pip took
# ~2 min 15 s (1 min 20 s without compiling every module, which uv leaves to Python's first
# import of each).
# PyPI's torchvision links CUDA libraries that the CPU torch lacks: torchaudio and torchcodec
# go (nothing here uses them) and deploy/vllm/sitecustomize.py lets torchvision's image code
# import without its compiled ops.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.requirements-installed

$(VLLM_STAMP): requirements-vllm.txt deploy/vllm/sitecustomize.py $(STAMP)
	@test -x $(VLLM_VENV)/bin/python || $(UV) venv -q --python $(PYTHON) $(VLLM_VENV)
	$(UV) pip install -q --python $(VLLM_VENV)/bin/python $$($(PY) scripts/uv_sources.py) -r requirements-vllm.txt
	$(UV) pip uninstall -q --python $(VLLM_VENV)/bin/python torchaudio torchcodec
	cp deploy/vllm/sitecustomize.py "$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/"
	$(VLLM_VENV)/bin/python -c "import torchvision, vllm; from transformers import Qwen2VLImageProcessor"
	@touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# vLLM's tests alone (marker `vllm`: tests/test_vllm_engine.py), which start vLLM engines from
# .venv-vllm (built first when missing); `make test` runs them with the rest.
test-vllm: install vllm
	@bash scripts/ensure_redis.sh
	$(PY) -m pytest -m vllm $(PYTEST_ARGS)
