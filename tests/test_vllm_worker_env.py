"""What `run_worker --engine vllm` refuses, and sets in its environment, before vLLM loads
(threads, and where the model runs on a CPU). Pure: no vLLM needed, and no process started: a
refusal comes before the command reads Redis or loads anything, so it is the same here as in a
worker process of vLLM's virtualenv."""

from __future__ import annotations

import json
import os

import pytest
from django.core.management import CommandError, call_command

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


@pytest.fixture
def refused_before_loading(monkeypatch, tmp_path):
    """A `run_worker --engine vllm` call on a Qwen2-VL checkpoint's config, which fails the test
    if the command gets as far as Redis or vLLM instead of refusing first; returns its error."""

    def nothing_further(*args, **kwargs):
        raise AssertionError("run_worker went on past its vLLM checks")

    monkeypatch.setattr(run_worker, "sync_client", nothing_further)
    monkeypatch.setattr(run_worker, "_vllm_runtime", nothing_further)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_vl"}))

    def run(*extra: str) -> CommandError:
        with pytest.raises(CommandError) as refused:
            call_command(
                "run_worker", "--name", "v", "--engine", "vllm", "--model-path", str(tmp_path), *extra
            )
        return refused.value

    return run


def test_a_vllm_worker_refuses_a_block_size_that_is_not_vllms(refused_before_loading, settings):
    # given a deployment hashing prompts in blocks of 16, which vLLM's CPU attention cannot take
    settings.KV_BLOCK_SIZE = 16

    # when a vLLM worker starts on a CPU, then it refuses, naming the setting and the fix
    assert "KV_BLOCK_SIZE=32" in str(refused_before_loading("--device", "cpu"))


def test_a_vllm_worker_refuses_to_be_an_encode_worker(refused_before_loading, settings):
    settings.KV_BLOCK_SIZE = 32
    assert "--role encode" in str(refused_before_loading("--role", "encode"))
