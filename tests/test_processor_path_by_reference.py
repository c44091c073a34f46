"""The processor path (DYN_CHAT_PROCESSOR=transformers) hands the worker the frontend processor's
tensors, pixel values included: megabytes per image. Like image bytes, they travel through the
media side store by reference, never inside the Celery message (issue 11, media by reference)."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
import torch
from asgiref.sync import async_to_sync

from inference_platform.api.chat_request import parse_chat_request
from inference_platform.serving.frontend import frontend
from inference_platform.serving.prepare import prepare
from inference_platform.serving.served import arelease_media, store_media
from routing.media.store import MediaRef
from routing.prompt.processor_view import decode_processed
from tests.test_token_view import png_data_url, two_image_request

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("served_demo_model")]


def _carries_raw_bytes(value) -> bool:
    """Whether any tensor in `value` still has its `b64` field (a key, not a substring: the
    request id's random hex may spell "b64")."""
    if isinstance(value, dict):
        return "b64" in value or any(_carries_raw_bytes(v) for v in value.values())
    if isinstance(value, list):
        return any(_carries_raw_bytes(v) for v in value)
    return False


def test_the_processed_tensors_go_to_the_side_store_and_come_back_exactly(settings) -> None:
    # given a request prepared on the processor path, with two images
    settings.DYN_CHAT_PROCESSOR = "transformers"
    body = two_image_request("demo", png_data_url(640, 480), png_data_url(123, 457, (10, 200, 10)))
    prepared = prepare(parse_chat_request(body, max_tokens_limit=64))
    assert prepared.processed is not None
    inline = json.dumps(prepared.processed)
    owner, stored = f"by-ref-{uuid.uuid4().hex[:8]}", []

    # when the frontend stores the request's media
    _, _, processed = async_to_sync(store_media)(prepared, owner, stored)
    try:
        # then the task carries references: no raw tensor bytes, a message a fraction of the size
        carried = json.dumps(processed)
        assert not _carries_raw_bytes(processed), "raw tensor bytes left in the task"
        assert processed["pixel_values"]["media_ref"]
        assert len(carried) * 20 < len(inline), (len(carried), len(inline))
        assert len(stored) >= 1
        # and the worker reads back exactly the tensors the processor made
        store = frontend().media_store()
        again = decode_processed(processed, lambda payload: store.get(MediaRef.from_payload(payload)))
        expected = decode_processed(prepared.processed)
        assert set(again) == set(expected)
        for key, tensor in expected.items():
            assert torch.equal(again[key], tensor), key
    finally:
        async_to_sync(arelease_media)(owner, stored)

    # and once the request is done its tensors are gone: a reference never outlives it
    with pytest.raises(Exception, match="no longer stored"):
        frontend().media_store().get(MediaRef.from_payload(processed["pixel_values"]))


def test_a_tensor_whose_bytes_do_not_match_its_shape_is_refused() -> None:
    processed = {
        "input_ids": [1, 2],
        "pixel_values": {"dtype": "float32", "shape": [2, 3], "media_ref": "k", "media_bytes": 20},
    }
    with pytest.raises(ValueError, match="holds 20 bytes"):
        decode_processed(processed, lambda payload: b"\0" * 20)


def test_the_processor_path_answers_as_the_registry_path_on_real_processes(
    shared_platform, pooled_platform
) -> None:
    # given the shared frontend, and a frontend of the same workers on the processor path
    platform = shared_platform
    processor = pooled_platform()
    processor_url = processor.start_server(DYN_CHAT_PROCESSOR="transformers")
    body = {
        **two_image_request("demo", png_data_url(300, 200), png_data_url(200, 300, (10, 200, 10))),
        "max_tokens": 8,
        "temperature": 0,
    }

    # when the same request goes through each path
    answers = [
        httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=90)
        for url, headers in ((platform.base_url, platform.headers), (processor_url, processor.headers))
    ]

    # then both are answered, with the same greedy text
    assert [a.status_code for a in answers] == [200, 200], [a.text for a in answers]
    texts = [a.json()["choices"][0]["message"]["content"] for a in answers]
    assert texts[0] == texts[1]
