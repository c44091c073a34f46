"""The routing-only token view: the frontend sees the prompt exactly as the worker's processor builds it."""

from __future__ import annotations

import base64
import io
import json
import shutil

import pytest
from asgiref.sync import sync_to_async
from django.core.management import CommandError, call_command
from PIL import Image

from inference_platform.api.chat_request import parse_chat_request
from inference_platform.api.errors import ApiError
from inference_platform.serving.prepare import prepare
from routing.media.images import routing_hash, url_identity
from routing.media.store import MediaRef
from routing.prompt.hashing import MediaPlacement, block_hashes, partition_salt
from routing.prompt.model_view import model_view
from tests.api_client import KeyedAsyncClient

# The frontend reads the live policy (the admin's row, if any) from the database.
pytestmark = pytest.mark.django_db


def png_data_url(width: int, height: int, colour: tuple[int, int, int] = (200, 30, 30)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def two_image_request(model: str, first: str, second: str) -> dict:
    return {
        "model": model,
        "messages": [
            {"role": "system", "content": "You compare pictures."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Here is the first picture:"},
                    {"type": "image_url", "image_url": {"url": first}},
                    {"type": "text", "text": "and the second one:"},
                    {"type": "image_url", "image_url": {"url": second}},
                    {"type": "text", "text": "Which is redder?"},
                ],
            },
        ],
    }


@pytest.fixture(autouse=True)
def served_demo_model(served_demo_model, settings):
    settings.DYN_MM_FRONTEND_DECODING = False
    return served_demo_model


def test_token_view_equals_the_worker_processors_input_ids_for_text_and_two_images(demo_model_dir):
    from workers.processors import load_processor

    first, second = png_data_url(640, 480), png_data_url(123, 457, (10, 200, 10))
    chat = parse_chat_request(two_image_request("demo", first, second), max_tokens_limit=64)
    prepared = prepare(chat)

    processor = load_processor(demo_model_dir)
    images = [
        Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1]))).convert("RGB")
        for url in (first, second)
    ]
    expected = processor(text=[prepared.prompt], images=images, return_tensors="pt")["input_ids"][0].tolist()

    assert prepared.view.tokens == expected
    assert prepared.view.fallback is None
    sizes = [(i.width, i.height) for i in prepared.view.images]
    assert sizes == [(640, 480), (123, 457)]
    placeholder = model_view(demo_model_dir).image_placeholder_id
    for image in prepared.view.images:
        run = expected[image.start : image.start + image.tokens]
        assert run == [placeholder] * image.tokens
        assert (
            expected[image.start - 1] != placeholder and expected[image.start + image.tokens] != placeholder
        )


def test_block_hashes_fold_each_image_identity_at_its_place(demo_model_dir):
    first, second = png_data_url(64, 64), png_data_url(64, 64, (0, 0, 255))
    prepared = prepare(parse_chat_request(two_image_request("demo", first, second), max_tokens_limit=64))
    view = prepared.view
    media = [
        MediaPlacement(routing_hash(url_identity(url)), i.start, i.tokens)
        for url, i in zip((first, second), view.images, strict=True)
    ]
    # In the served model's KV partition, as its workers hash them.
    assert prepared.fingerprint
    salt = partition_salt(prepared.fingerprint, None)
    assert view.block_hashes == block_hashes(view.tokens, 16, media, salt=salt)
    assert [i.identity for i in view.images] == [url_identity(first), url_identity(second)]

    swapped = prepare(parse_chat_request(two_image_request("demo", second, first), max_tokens_limit=64)).view
    first_image_block = view.images[0].start // 16
    assert swapped.block_hashes[:first_image_block] == view.block_hashes[:first_image_block]
    assert swapped.block_hashes[first_image_block] != view.block_hashes[first_image_block]


def test_frontend_decoding_gives_one_identity_for_the_same_pixels_under_two_encodings(settings):
    settings.DYN_MM_FRONTEND_DECODING = True
    png = png_data_url(32, 32)
    image = Image.open(io.BytesIO(base64.b64decode(png.split(",", 1)[1])))
    buffer = io.BytesIO()
    image.save(buffer, format="BMP")
    bmp = "data:image/bmp;base64," + base64.b64encode(buffer.getvalue()).decode()
    prepared = prepare(parse_chat_request(two_image_request("demo", png, bmp), max_tokens_limit=64))
    first, second = prepared.view.images
    assert first.identity == second.identity
    assert all(image.data for image in prepared.images), "decoded bytes travel to the worker"
    refs = {image.index: MediaRef(f"blob-{image.index}", len(image.data)) for image in prepared.images}
    task = prepared.generate_task("r1", None, refs)
    # the bytes travel by reference to the side store, never inside the task
    assert [image.media_ref for image in task.images] == ["blob-0", "blob-1"]
    assert all(image.url is None and image.data_b64 is None for image in task.images)


def test_a_family_without_a_layout_routes_on_the_text_prefix(settings, demo_model_dir, tmp_path):
    other = tmp_path / "mystery"
    shutil.copytree(demo_model_dir, other, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "config.json").read_text())
    config["model_type"] = "mystery_vl"
    (other / "config.json").write_text(json.dumps(config))
    settings.MODEL_PATH = other
    prepared = prepare(
        parse_chat_request(
            two_image_request("mystery", png_data_url(50, 50), png_data_url(60, 60)), max_tokens_limit=64
        )
    )
    assert prepared.view.fallback and "mystery_vl" in prepared.view.fallback
    first_placeholder = prepared.view.images[0].start
    assert prepared.view.tokens == prepared.model.encode(prepared.prompt)[:first_placeholder]


def test_an_extreme_aspect_ratio_is_refused_with_a_422(demo_model_dir):
    chat = parse_chat_request(
        two_image_request("demo", png_data_url(1, 400), png_data_url(20, 20)), max_tokens_limit=64
    )
    with pytest.raises(ApiError) as refused:
        prepare(chat)
    assert refused.value.status == 422
    assert refused.value.code == "image_size_refused"


def test_inspect_request_asks_the_model_its_model_option_names(tmp_path):
    # given a request body naming the deployment's model
    path = tmp_path / "request.json"
    path.write_text(json.dumps(two_image_request("demo", png_data_url(100, 80), png_data_url(80, 100))))
    # when an operator asks another model with it
    with pytest.raises(CommandError) as refused:
        call_command("inspect_request", str(path), "--model", "no-such-model")
    # then it is that model that answers, here as a client would be answered
    assert "404 model_not_found" in str(refused.value) and "no-such-model" in str(refused.value)


def test_inspect_request_prints_the_view_as_json(tmp_path, capsys):
    body = two_image_request("demo", png_data_url(100, 80), png_data_url(80, 100))
    del body["model"]  # the configured model is assumed
    path = tmp_path / "request.json"
    path.write_text(json.dumps(body))
    call_command("inspect_request", str(path), "--json")
    printed = json.loads(capsys.readouterr().out)
    assert {"prompt_tokens", "block_size", "block_hashes", "fallback", "images"} <= set(printed)
    assert printed["fallback"] is None
    assert all(isinstance(h, int) for h in printed["block_hashes"])
    assert [(i["width"], i["height"]) for i in printed["images"]] == [(100, 80), (80, 100)]
    assert all(i["tokens"] > 0 and len(i["identity"]) == 32 for i in printed["images"])


@pytest.mark.django_db(transaction=True)
async def test_route_endpoint_shows_the_view_without_dispatching(api_headers):
    body = two_image_request("demo", png_data_url(100, 80), png_data_url(80, 100))
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/route", data=json.dumps(body), content_type="application/json"
    )
    assert response.status_code == 200, response.content
    described = json.loads(response.content)
    assert described["prompt_tokens"] == len(
        prepare(parse_chat_request(body, max_tokens_limit=64)).view.tokens
    )
    assert len(described["images"]) == 2
    assert described["candidates"] == []


@pytest.mark.django_db(transaction=True)
async def test_a_conversation_sending_its_pictures_again_is_routed_alike_without_decoding_them_again(
    api_headers, settings, monkeypatch
):
    import routing.media.images as images

    decodings: list[str] = []
    real_decode = images.decode_data_url
    monkeypatch.setattr(
        images, "decode_data_url", lambda url, **kw: decodings.append(url) or real_decode(url, **kw)
    )
    body = two_image_request("demo", png_data_url(100, 80), png_data_url(80, 100, (9, 9, 9)))

    async def routed() -> dict:
        response = await KeyedAsyncClient(api_headers).post(
            "/v1/route", data=json.dumps(body), content_type="application/json"
        )
        assert response.status_code == 200, response.content
        return json.loads(response.content)

    # a second turn sending the same two pictures: the same view, and no decoding
    first = await routed()
    assert len(decodings) == 2
    assert await routed() == first and len(decodings) == 2
    # with the frontend told to keep none (MEDIA_DATA_URL_CACHE_MB=0), each turn decodes them
    settings.MEDIA_DATA_URL_CACHE_MB = 0
    assert await routed() == first and len(decodings) == 4


@pytest.mark.django_db(transaction=True)
async def test_an_image_refused_by_the_guard_is_a_4xx_naming_it(api_headers):
    body = two_image_request("demo", png_data_url(10, 10), "http://169.254.169.254/latest/meta-data/x.png")
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/chat/completions", data=json.dumps(body), content_type="application/json"
    )
    assert response.status_code == 403
    error = json.loads(response.content)["error"]
    assert error["code"] == "address_refused"
    assert error["message"].startswith("image 1")
    bad = two_image_request("demo", "ftp://example.com/a.png", png_data_url(10, 10))
    response = await KeyedAsyncClient(api_headers).post(
        "/v1/chat/completions", data=json.dumps(bad), content_type="application/json"
    )
    # a scheme the platform never fetches is refused by the parser, which names the URL's field
    assert response.status_code == 400
    assert json.loads(response.content)["error"]["param"] == "messages[1].content[1].image_url.url"


def test_the_processor_path_gives_the_registry_view_for_the_demo_model(settings):
    first, second = png_data_url(640, 480), png_data_url(123, 457, (10, 200, 10))
    chat = parse_chat_request(two_image_request("demo", first, second), max_tokens_limit=64)
    registry_view = prepare(chat)
    settings.DYN_CHAT_PROCESSOR = "transformers"
    processor_view = prepare(chat)
    assert processor_view.describe()["chat_processor"] == "transformers"
    assert processor_view.view.tokens == registry_view.view.tokens
    assert processor_view.view.block_hashes == registry_view.view.block_hashes
    assert [i.identity for i in processor_view.view.images] == [i.identity for i in registry_view.view.images]
    task = processor_view.generate_task("r1", None)
    assert task.processed["input_ids"] == registry_view.view.tokens
    assert registry_view.generate_task("r1", None).processed is None


def test_the_processor_path_routes_a_family_outside_the_registry_exactly(settings, tmp_path):
    from tests.test_processor_view import build_gemma3_checkpoint

    gemma = tmp_path / "gemma3-tiny"
    build_gemma3_checkpoint(gemma)
    settings.MODEL_PATH = gemma
    body = two_image_request("gemma3-tiny", png_data_url(64, 64), png_data_url(96, 64, (1, 2, 3)))
    body["messages"] = body["messages"][1:]  # Gemma's template folds system prompts differently
    chat = parse_chat_request(body, max_tokens_limit=64)
    assert prepare(chat).view.fallback is not None  # the registry alone routes on text
    settings.DYN_CHAT_PROCESSOR = "transformers"
    exact = prepare(chat).view
    assert exact.fallback is None
    assert [image.tokens > 0 for image in exact.images] == [True, True]
    assert len(exact.tokens) == exact.prompt_tokens


def test_inspect_request_shows_each_workers_overlap_load_and_cost_as_the_router_scores_them(
    tmp_path, capsys, settings, served_demo_model
):
    from routing.fleet.registry import Heartbeat, WorkerRegistry
    from routing.models import Worker
    from routing.policy import current_policy
    from routing.state.redis_keys import sync_client

    # given two idle live workers of the model and a third one draining
    registry = WorkerRegistry(sync_client(settings.REDIS_URL), settings.REDIS_KEY_PREFIX)
    for name in ("idle-a", "idle-b", "leaving"):
        Worker.objects.create(name=name, model_name=served_demo_model, draining=name == "leaving")
        registry.beat(Heartbeat(name=name, model=served_demo_model, block_size=settings.KV_BLOCK_SIZE), 30)
    path = tmp_path / "request.json"
    path.write_text(json.dumps(two_image_request("demo", png_data_url(100, 80), png_data_url(80, 100))))
    try:
        call_command("inspect_request", str(path), "--json")
        printed = json.loads(capsys.readouterr().out)
        call_command("inspect_request", str(path))
        text = capsys.readouterr().out
    finally:
        for name in ("idle-a", "idle-b", "leaving"):
            registry.remove(name)

    # then each eligible worker carries the cost terms of the router's formula (nothing cached,
    # no load: prefill ISL/bs blocks, decode all n blocks), and the draining one says why not
    isl, block_size = printed["prompt_tokens"], printed["block_size"]
    prefill, decode = isl / block_size, float(-(-isl // block_size))
    scale = current_policy().routing.prefill_load_scale
    by_name = {worker["worker"]: worker for worker in printed["candidates"]}
    for name in ("idle-a", "idle-b"):
        assert by_name[name]["overlap"] == 0
        assert by_name[name]["prefill_blocks"] == pytest.approx(prefill)
        assert by_name[name]["decode_blocks"] == pytest.approx(decode)
        assert by_name[name]["cost"] == pytest.approx(scale * prefill + decode)
    assert by_name["leaving"]["ineligible_because"] == "draining" and "cost" not in by_name["leaving"]
    assert printed["choice"]["worker"] in ("idle-a", "idle-b")
    # and the text says the same, one row per worker
    assert f"{scale * prefill + decode:.2f}" in text
    assert "leaving" in text and "not eligible: draining" in text
    # (equal costs: the router breaks the tie at random, each run afresh)
    assert "choice         idle-a: 0/" in text or "choice         idle-b: 0/" in text


def test_inspect_request_without_redis_still_prints_the_view_and_says_why_no_workers(
    tmp_path, capsys, settings
):
    settings.REDIS_URL = "redis://127.0.0.1:9/0"
    path = tmp_path / "request.json"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}]}))
    call_command("inspect_request", str(path))
    printed = capsys.readouterr().out
    assert "prompt tokens" in printed and "workers        unknown: Redis did not answer" in printed


@pytest.mark.django_db(transaction=True)
async def test_inspect_request_hashes_as_the_route_endpoint_does_for_the_tenants_key(
    tmp_path, capsys, make_api_key
):
    """The command folds in the tenant's salt (--tenant) and the body's cache_salt, as the API does."""
    body = two_image_request("demo", png_data_url(100, 80), png_data_url(80, 100))
    headers = {"Authorization": f"Bearer {await sync_to_async(make_api_key)('inspected', staff=True)}"}

    async def routed(request_body) -> list[int]:
        response = await KeyedAsyncClient(headers).post(
            "/v1/route", data=json.dumps(request_body), content_type="application/json"
        )
        assert response.status_code == 200, response.content
        return json.loads(response.content)["block_hashes"]

    async def inspected(request_body, *args) -> tuple[list[int], str]:
        path = tmp_path / "request.json"
        path.write_text(json.dumps(request_body))
        await sync_to_async(call_command)("inspect_request", str(path), "--json", *args)
        hashes = json.loads(capsys.readouterr().out)["block_hashes"]
        await sync_to_async(call_command)("inspect_request", str(path), *args)
        return hashes, capsys.readouterr().out

    for request_body in (body, {**body, "cache_salt": "team-a"}):
        tenant_hashes, printed = await inspected(request_body, "--tenant", "inspected")
        assert tenant_hashes == await routed(request_body)
        assert "tenant 'inspected'" in printed
        shared_hashes, printed = await inspected(request_body)
        assert shared_hashes[0] != tenant_hashes[0]
    assert "the body's cache_salt" in printed
    unsalted, printed = await inspected(body)
    assert "none: the shared pool" in printed
    assert unsalted != shared_hashes

    with pytest.raises(CommandError, match="No tenant is named 'nobody'"):
        await sync_to_async(call_command)(
            "inspect_request", str(tmp_path / "request.json"), "--tenant", "nobody"
        )
