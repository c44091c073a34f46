"""What `run_worker --engine vllm` sets in its environment before vLLM loads. Pure: no vLLM
needed."""

from __future__ import annotations

import os

import pytest

from workers.management.commands import run_worker

VARIABLES = ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS", "VLLM_ENABLE_V1_MULTIPROCESSING")


@pytest.fixture
def environment(monkeypatch):
    """The process environment with none of the variables set; monkeypatch restores it."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_the_engine_runs_unbound_with_its_threads_and_vllms_own_executor(environment):
    run_worker._bound_vllm_threads(2)

    assert {name: os.environ.get(name) for name in VARIABLES} == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": None,
    }


def test_an_operators_own_binding_is_left_as_it_is(environment):
    environment.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")

    run_worker._bound_vllm_threads(2)

    assert {name: os.environ.get(name) for name in VARIABLES} == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-3",
        "OMP_NUM_THREADS": None,
        "VLLM_ENABLE_V1_MULTIPROCESSING": None,
    }
