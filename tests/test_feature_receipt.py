"""The LLM worker's receipt of an encode worker's features, against the real Redis and media side
store, with the faults injected by hand (a flipped byte, a released blob, an encoder that fails,
stays silent or dies): each such image is left to local encoding and counted by cause."""

from __future__ import annotations

import pytest
import torch

from routing.contract.tasks import GenerateTask, ImageRef
from routing.fleet.encoders import EncoderPool
from routing.fleet.registry import Heartbeat, WorkerRegistry
from routing.media.store import MediaRef, MediaStore
from workers.disaggregation import features_owner, receive_features
from workers.embedding_transfer import EmbeddingLabel, pack_embedding
from workers.engine import ImageInput

IDENTITIES = ["a" * 32, "b" * 32]


@pytest.fixture
def parts(redis_client, key_namespace):
    pool = EncoderPool(redis_client, key_namespace)
    store = MediaStore(redis_client, key_namespace)
    registry = WorkerRegistry(redis_client, key_namespace)
    registry.beat(Heartbeat(name="enc", model="demo", block_size=16, role="encode"), ttl_s=30)
    return pool, store, registry


def label(identity: str) -> EmbeddingLabel:
    return EmbeddingLabel(identity, "demo", "fp")


def task(wait_s: float = 2.0) -> GenerateTask:
    return GenerateTask(
        request_id="req-1",
        prompt="p",
        max_tokens=1,
        images=tuple(ImageRef(identity=i) for i in IDENTITIES),
        encoder="enc",
        encoded_images=(0, 1),
        encode_wait_s=wait_s,
    )


def receive(parts, the_task: GenerateTask):
    pool, store, registry = parts
    images = [ImageInput(identity=i) for i in IDENTITIES]
    receipt = receive_features(
        the_task, images, label=label, pool=pool, store=store, registry=registry, worker="llm"
    )
    return receipt, images, pool.snapshot(["llm"])["llm"]


def put_features(parts, index: int, tensor: torch.Tensor, *, corrupt: bool = False) -> dict:
    pool, store, _ = parts
    blob = bytearray(pack_embedding(tensor, label(IDENTITIES[index])))
    if corrupt:
        blob[-1] ^= 0xFF
    ref = store.put(features_owner("req-1"), bytes(blob))
    pool.signal_done("req-1", {"index": index, "ok": True, "ref": ref.to_payload()})
    return ref.to_payload()


def test_intact_features_are_set_on_their_images_and_counted(parts) -> None:
    features = [torch.randn(4, 8), torch.randn(6, 8)]
    put_features(parts, 1, features[1])
    put_features(parts, 0, features[0])

    receipt, images, counters = receive(parts, task())

    assert torch.equal(images[0].embedding, features[0]) and torch.equal(images[1].embedding, features[1])
    assert (receipt.received, receipt.fallbacks) == (2, {})
    assert counters["received"] == 2 and counters["received_bytes"] > 0
    # the blobs were released once read
    assert parts[1].total_bytes() == 0


def test_fault_injected_corrupt_features_fall_back_and_are_counted(parts, caplog) -> None:
    put_features(parts, 0, torch.randn(4, 8), corrupt=True)
    put_features(parts, 1, torch.randn(6, 8))

    receipt, images, counters = receive(parts, task())

    assert images[0].embedding is None and images[1].embedding is not None
    assert receipt.fallbacks == {"corrupt": 1} and counters["fallback_corrupt"] == 1
    assert "encoding image(s) 0 locally (fallback): its features are corrupt" in caplog.text


def test_fault_injected_missing_blob_and_failed_encoder_fall_back_as_missing(parts) -> None:
    pool, store, _ = parts
    ref = put_features(parts, 0, torch.randn(4, 8))
    store.release(features_owner("req-1"), [MediaRef.from_payload(ref)])  # gone before it is read
    pool.signal_done("req-1", {"index": 1, "ok": False, "error": "OSError: origin refused"})

    receipt, images, counters = receive(parts, task())

    assert images[0].embedding is None and images[1].embedding is None
    assert receipt.fallbacks == {"missing": 2} and counters["fallback_missing"] == 2


def test_fault_injected_silent_encoder_times_out_and_a_dead_one_is_noticed(parts) -> None:
    put_features(parts, 0, torch.randn(4, 8))

    receipt, images, _ = receive(parts, task(wait_s=0.6))
    assert images[0].embedding is not None and receipt.fallbacks == {"timeout": 1}

    parts[2].remove("enc")  # its heartbeat is gone: no point waiting out the deadline
    receipt, images, counters = receive(parts, task(wait_s=30))
    assert receipt.fallbacks == {"encoder_gone": 2} and counters["fallback_encoder_gone"] == 2
