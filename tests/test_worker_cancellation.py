"""A worker stops generating a request nobody will read: the frontend cancelled it, or the
frontend process following it died (its liveness mark lapsed). The request leaves the engine's
batch and its KV blocks go back to the pool."""

from __future__ import annotations

import threading
import time

import pytest

from routing.contract.responses import DONE, TOKEN, cancel_key, live_key, parse_stream_entries, response_key
from routing.contract.tasks import GenerateTask

PROMPT = "<|im_start|>user\nWrite a very long story about a garden.<|im_end|>\n<|im_start|>assistant\n"
MAX_TOKENS = 3000


def serve_in_background(runtime, request_id: str) -> threading.Thread:
    task = GenerateTask(
        request_id=request_id,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=1.0,
        seed=1,
        follow_id=f"follow-{request_id}",
    )
    thread = threading.Thread(target=runtime.serve, args=(task.to_payload(),))
    thread.start()
    return thread


def wait_for_tokens(redis_client, key: str) -> None:
    deadline = time.monotonic() + 60
    while not any(e.type == TOKEN for e in parse_stream_entries(redis_client.xrange(key))):
        assert time.monotonic() < deadline, "no token came"
        time.sleep(0.05)


@pytest.fixture
def runtime(demo_engine, redis_client, key_namespace):
    from workers.runtime import WorkerRuntime

    engine = demo_engine(capacity=512)
    return WorkerRuntime(name="w", engine=engine, client=redis_client, namespace=key_namespace)


@pytest.mark.parametrize("how", ["cancel-key", "liveness-lapsed"])
def test_a_request_nobody_will_read_leaves_the_batch_and_frees_its_blocks(
    runtime, redis_client, key_namespace, how: str
) -> None:
    # given a long request whose frontend keeps its liveness mark alive
    rid = f"r-{how}"
    redis_client.set(live_key(key_namespace, f"follow-{rid}"), b"1", px=60_000)
    thread = serve_in_background(runtime, rid)
    wait_for_tokens(redis_client, response_key(key_namespace, rid))

    # when the frontend cancels it, or dies (its liveness mark lapses)
    if how == "cancel-key":
        redis_client.set(cancel_key(key_namespace, rid), b"1", ex=60)
    else:
        redis_client.delete(live_key(key_namespace, f"follow-{rid}"))
    thread.join(timeout=30)

    # then the worker stopped well before max_tokens and its engine holds nothing
    assert not thread.is_alive()
    events = parse_stream_entries(redis_client.xrange(response_key(key_namespace, rid)))
    tokens = sum(1 for e in events if e.type == TOKEN)
    assert 0 < tokens < MAX_TOKENS
    if how == "cancel-key":
        assert 0 < next(e for e in events if e.type == DONE).data["completion_tokens"] < MAX_TOKENS
    report = runtime.engine.load_report()
    assert report.running == report.waiting == report.kv_blocks_used == 0
