"""The whole request path across real processes: uvicorn → Celery (Redis broker) → run_worker → model.

The tests of answers talk HTTP, as a client would, to the session's pool of `run_worker` processes
with the demo model behind a real ASGI server (their own where they need settings of their own,
else the session's). A worker stopped or killed is a fault: tests/test_routing_faults.py (SIGTERM)
and tests/test_faults.py (SIGKILL) do it to simulated workers of their own.
"""

from __future__ import annotations

import importlib
import io
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from PIL import Image

from tests.conftest import POOL_WORKERS
from tests.image_server import ImageServer
from tests.platform_harness import REPO


def ask(platform, text: str, *, max_tokens: int = 8, **extra) -> httpx.Response:
    """A chat request to the platform's first frontend, with the harness's API key."""
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        **extra,
    }
    return httpx.post(
        f"{platform.base_url}/v1/chat/completions", json=body, headers=platform.headers, timeout=60
    )


def test_worker_processes_answer_requests_with_the_model(pooled_platform):
    # Round robin: the KV router would rightly keep sending a repeated prompt to one worker.
    platform = pooled_platform(ROUTER_MODE="round_robin")
    platform.start_server()

    answers: dict[str, list[str]] = {name: [] for name in POOL_WORKERS}
    served_before: set[str] = set()
    request_ids: list[str] = []
    for _ in range(len(POOL_WORKERS) + 1):
        response = ask(platform, "Describe a red bicycle.")
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "chat.completion"
        assert response.headers["X-Request-Id"] == body["id"]
        request_ids.append(body["id"])
        usage = body["usage"]
        assert usage["completion_tokens"] > 0
        assert usage["prompt_tokens"] > 10
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        # a worker that served this prompt before holds its prefix: cached, in whole blocks
        worker = response.headers["X-Routed-Worker"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if worker in served_before:
            assert 0 < cached <= usage["prompt_tokens"] and cached % 16 == 0, usage
        else:
            assert cached == 0, usage
        served_before.add(worker)
        assert body["choices"][0]["finish_reason"] in ("stop", "length")
        answers[worker].append(body["choices"][0]["message"]["content"])

    # Every process answered, and being the same model under greedy decoding, identically.
    assert all(answers.values()), answers
    texts = {text for texts in answers.values() for text in texts}
    assert len(texts) == 1
    (text,) = texts
    assert text.strip()
    # Answered requests leave no response stream behind in Redis.
    left = {key.decode() for key in platform.redis.scan_iter(match=f"{platform.namespace}resp:*")}
    assert not {key for key in left if any(request_id in key for request_id in request_ids)}, left
    # A different prompt makes the model say something else: the text comes from the model.
    other = ask(platform, "What is the capital of a country made of glass?", max_tokens=8).json()
    assert other["choices"][0]["message"]["content"] != text


def test_streaming_sends_chunks_then_done(pooled_frontend):
    platform = pooled_frontend
    base_url = platform.base_url

    # The same server serves the admin, styled: its static files come from the ASGI app itself.
    assert httpx.get(f"{base_url}/admin/login/", timeout=10).status_code == 200
    css = httpx.get(f"{base_url}/static/admin/css/base.css", timeout=10)
    assert css.status_code == 200 and "text/css" in css.headers["content-type"]

    whole = ask(platform, "Tell me about rivers.", max_tokens=12).json()["choices"][0]["message"]["content"]
    body = {
        "model": "demo",
        "messages": [{"role": "user", "content": "Tell me about rivers."}],
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    pieces, finish, usage = [], None, None
    with httpx.stream(
        "POST", f"{base_url}/v1/chat/completions", json=body, headers=platform.headers, timeout=60
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        chunk = json.loads(line[len("data: ") :])
        if chunk.get("usage"):
            usage = chunk["usage"]
            continue
        choice = chunk["choices"][0]
        pieces.append(choice["delta"].get("content", ""))
        finish = choice["finish_reason"] or finish
    assert "".join(pieces) == whole
    assert finish in ("stop", "length")
    assert usage and usage["completion_tokens"] > 0


@pytest.mark.django_db  # importing the ASGI app reads the deployment id, in this process too
def test_stdlib_platform_module_works_in_each_process(platform_processes):
    """Our project package is not called `platform`, so the standard library's stays importable."""
    # The frontend's start-up reads its deployment id: it runs on the harness's migrated database.
    env = platform_processes().env
    code = "import platform; print(platform.system())"
    for args in (
        [
            sys.executable,
            "-c",
            f"import django, os; os.environ['DJANGO_SETTINGS_MODULE']='inference_platform.settings'; "
            f"django.setup(); import inference_platform.asgi; {code}",
        ],
        [sys.executable, "-c", f"import workers.engine; {code}"],
    ):
        out = subprocess.run(
            args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=True
        ).stdout
        assert out.strip().splitlines()[-1] in ("Linux", "Darwin", "Windows")
    # and in this process, which imported the project's packages too: the module is the stdlib's
    import sysconfig

    import inference_platform.asgi  # noqa: F401
    import workers.engine  # noqa: F401

    stdlib_platform = importlib.import_module("platform")
    stdlib_dir = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert Path(stdlib_platform.__file__).resolve().parent == stdlib_dir
    assert stdlib_platform.system() in ("Linux", "Darwin", "Windows")


def test_the_official_openai_client_works_against_the_platform(pooled_frontend):
    import openai

    platform = pooled_frontend
    base_url = platform.base_url
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=platform.api_key, max_retries=0)

    assert [model.id for model in client.models.list()] == ["demo"]
    completion = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0
    )
    assert completion.choices[0].message.content
    assert completion.usage.prompt_tokens_details.cached_tokens == 0  # a fresh tenant
    again = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6, temperature=0
    )
    assert 0 < again.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens
    stream = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == completion.choices[0].message.content
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-17", messages=[{"role": "user", "content": "Hi"}])
    assert missing.value.code == "model_not_found"


def test_an_origin_allowed_on_the_frontend_only_is_refused_by_the_worker_with_the_same_context(
    pooled_platform,
):
    # given the pool's workers, which allow the origins of MEDIA_ALLOWED_HOSTS=127.0.0.1, and a
    # frontend that allows all of loopback (a half-done setup: an origin added on one side only)
    platform = pooled_platform(MEDIA_ALLOWED_HOSTS="127.0.0.0/8")
    platform.start_server()
    picture = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 120, 200)).save(picture, format="PNG")
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": ""}}]
    # when a request names an image at 127.0.0.2 (the frontend reads its header, the worker fetches it)
    with ImageServer(host="127.0.0.2") as origin:
        content[1]["image_url"]["url"] = origin.add("/cat.png", picture.getvalue())
        response = ask(platform, "", messages=[{"role": "user", "content": content}])
    # then the worker's refusal reads as the frontend's would: the image, the part, the setting
    assert response.status_code == 403, response.text
    error = response.json()["error"]
    assert error["code"] == "address_refused"
    assert error["param"] == "messages[0].content[1].image_url"
    assert error["message"].startswith("image 0: ")
    assert "MEDIA_ALLOWED_HOSTS" in error["message"] and "every worker" in error["message"]
    assert response.headers["X-Routed-Worker"] in POOL_WORKERS
