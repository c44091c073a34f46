"""What `run_worker --engine vllm` sets in its environment before vLLM loads (threads, and where
the model runs on a CPU). Pure: no vLLM needed."""

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


def test_on_a_cpu_the_engine_runs_unbound_with_its_threads_and_the_model_in_the_engine_core(environment):
    environment.setattr(run_worker, "_cuda_available", lambda: False)

    run_worker._bound_vllm_threads(2)

    assert {name: os.environ.get(name) for name in VARIABLES} == {
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "2",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def test_an_operators_own_binding_keeps_vllms_multiprocess_executor(environment):
    environment.setattr(run_worker, "_cuda_available", lambda: False)
    environment.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-3")

    run_worker._bound_vllm_threads(2)

    assert {name: os.environ.get(name) for name in VARIABLES} == {
        "VLLM_CPU_OMP_THREADS_BIND": "0-3",
        "OMP_NUM_THREADS": None,
        "VLLM_ENABLE_V1_MULTIPROCESSING": None,
    }


def test_on_a_gpu_and_where_the_operator_chose_vllms_executor_stays_as_it_was(environment):
    environment.setattr(run_worker, "_cuda_available", lambda: True)
    run_worker._bound_vllm_threads(1)
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") is None

    environment.setattr(run_worker, "_cuda_available", lambda: False)
    environment.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    run_worker._bound_vllm_threads(1)
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "1"
