"""What every `/v1/*` request must be before a view reads it: size, JSON, content type, method.

Each refusal is a 4xx in OpenAI's error format, never Django's HTML page or a 500. The body limit
is tested twice: through the view (Django's own reader) and at the ASGI layer, where it must
stop reading a body as soon as the limit is crossed.
"""

from __future__ import annotations

import json

import pytest
from django.test import AsyncClient

from tests.api_client import KeyedAsyncClient

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("served_demo_model")]


@pytest.fixture
def client(api_headers) -> AsyncClient:
    return KeyedAsyncClient(api_headers)


def assert_openai_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.content[:300]
    assert response["Content-Type"].startswith("application/json")
    body = json.loads(response.content)
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code
    return body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/route"])
async def test_a_body_over_the_limit_is_a_413_in_the_openai_format(client, settings, path):
    # given a limit of 4 KiB (Django's own check follows the setting)
    settings.API_MAX_BODY_BYTES = settings.DATA_UPLOAD_MAX_MEMORY_SIZE = 4096
    body = {"model": "demo", "messages": [{"role": "user", "content": "x" * 5000}]}
    # when
    response = await client.post(path, data=json.dumps(body), content_type="application/json")
    # then
    assert_openai_error(response, 413, "request_too_large")


def test_the_default_body_limit_fits_a_data_url_of_the_largest_image_allowed(settings):
    largest_image = settings.DYN_MM_MAX_FILE_SIZE_MB * 1024 * 1024
    assert largest_image * 4 / 3 < settings.API_MAX_BODY_BYTES
    assert settings.DATA_UPLOAD_MAX_MEMORY_SIZE >= settings.API_MAX_BODY_BYTES


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/route"])
async def test_json_nested_a_thousand_deep_is_a_400_not_a_recursion_error(client, path):
    raw = b'{"model": "demo", "messages": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    response = await client.post(path, data=raw, content_type="application/json")
    body = assert_openai_error(response, 400, "invalid_json")
    assert "400 levels" in body["error"]["message"]


async def test_json_nested_past_the_bound_but_within_the_parser_is_still_refused(client):
    raw = b'{"model": "demo", "messages": ' + b"[" * 450 + b"]" * 450 + b"}"
    response = await client.post("/v1/chat/completions", data=raw, content_type="application/json")
    assert_openai_error(response, 400, "invalid_json")


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", ""])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/route"])
async def test_a_post_that_is_not_json_is_a_415(client, served_demo_model, path, content_type):
    # A browser's cross-site "simple" request may carry text/plain: it must not start a generation.
    body = json.dumps({"model": served_demo_model, "messages": [{"role": "user", "content": "hi"}]})
    response = await client.post(path, data=body, content_type=content_type)
    assert_openai_error(response, 415, "unsupported_media_type")


async def test_json_with_a_charset_parameter_is_accepted_as_json(client, served_demo_model):
    body = json.dumps({"model": served_demo_model, "messages": [{"role": "user", "content": "hi"}]})
    response = await client.post("/v1/route", data=body, content_type="application/json; charset=utf-8")
    assert response.status_code == 200, response.content


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("post", "/v1/models", 405, "method_not_allowed"),
        ("delete", "/v1/models", 405, "method_not_allowed"),
        ("put", "/v1/chat/completions", 405, "method_not_allowed"),
        ("get", "/v1/route", 405, "method_not_allowed"),
        ("get", "/v1", 404, "not_found"),
        ("post", "/v1", 404, "not_found"),
        ("get", "/v1/", 404, "not_found"),
        ("patch", "/v1/nothing/here", 404, "not_found"),
    ],
)
async def test_every_v1_answer_is_in_the_openai_error_format(client, method, path, status, code):
    if method == "get":
        response = await client.get(path)
    else:
        response = await getattr(client, method)(path, data=b"{}", content_type="application/json")
    assert_openai_error(response, status, code)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/embeddings", "/v1/embeddings/"])
async def test_openai_endpoints_not_served_are_a_404_pointing_at_chat_completions(client, path):
    response = await client.post(
        path, data=b'{"model": "demo", "input": "hi"}', content_type="application/json"
    )
    error = assert_openai_error(response, 404, "not_found")["error"]
    assert "is not served here" in error["message"]
    assert "/v1/chat/completions" in error["message"]


async def test_an_unknown_v1_path_lists_the_endpoints_this_server_serves(client):
    error = assert_openai_error(await client.get("/v1/nothing"), 404, "not_found")["error"]
    assert (
        "No route for GET /v1/nothing" in error["message"] and "POST /v1/chat/completions" in error["message"]
    )


async def test_a_post_to_metrics_is_a_405_not_the_csrf_page():
    client = AsyncClient(enforce_csrf_checks=True)
    response = await client.post("/metrics", data=b"x", content_type="text/plain")
    assert response.status_code == 405
    assert b"CSRF" not in response.content


# --- the ASGI layer --------------------------------------------------------------------------------
class _Recorder:
    """An ASGI app standing in for Django: records the body it was given."""

    def __init__(self) -> None:
        self.body: bytes | None = None

    async def __call__(self, scope, receive, send) -> None:
        message = await receive()
        self.body = message["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _run(limit: int, chunks: list[bytes], headers=()) -> tuple[_Recorder, list[dict], int]:
    from inference_platform.api.boundary import RequestBodyLimit

    app = _Recorder()
    sent: list[dict] = []
    reads = 0

    async def receive():
        nonlocal reads
        reads += 1
        index = reads - 1
        if index >= len(chunks):
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": chunks[index], "more_body": index < len(chunks) - 1}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/chat/completions", "headers": list(headers)}
    await RequestBodyLimit(app, limit)(scope, receive, send)
    return app, sent, reads


async def test_the_asgi_limit_stops_reading_a_body_once_it_crosses_the_limit():
    # given a body of 100 chunks of 1 KiB against a 4 KiB limit
    app, sent, reads = await _run(4096, [b"x" * 1024] * 100)
    # then it stopped at the fifth chunk and answered 413 without calling the app
    assert reads == 5
    assert app.body is None
    assert sent[0]["status"] == 413
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"


async def test_the_asgi_limit_refuses_a_declared_length_before_reading_anything():
    _app, sent, reads = await _run(4096, [b"x"], headers=[(b"content-length", b"999999")])
    assert reads == 0
    assert sent[0]["status"] == 413


async def test_the_asgi_limit_hands_a_body_within_it_to_the_app_whole():
    app, sent, _ = await _run(4096, [b"ab", b"cd", b"ef"])
    assert app.body == b"abcdef"
    assert sent[0]["status"] == 200
