"""Tenants against the real platform (the session's worker pool, a frontend of the module's own),
through the official `openai` client with max_retries=0: keys, limits, log probabilities, tenant
isolation of the caches, the OpenAPI document under schemathesis, and no key in the clear anywhere.

One frontend serves the whole module; each test makes tenants and keys of its own.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.conftest import POOL_WORKERS, TEST_REDIS_URL, WorkerPool
from tests.platform_harness import PlatformProcesses

# Long enough for several full KV blocks: the "secret" a second tenant must not be able to probe.
SECRET_PROMPT = (
    "Internal memo, do not share. The launch code for project Bluebird is 7341-ALPHA-9920. "
    "The merger with Crescent Holdings closes on the twelfth at a price of forty one dollars. "
    "Only the board knows the vault combination: left 37, right 12, left 88, right 4. "
    "Summarise this memo."
)
ISSUED_KEYS: list[str] = []  # every key the module issued, for the test that greps for them


@pytest.fixture(scope="module")
def platform(worker_pool: WorkerPool, tmp_path_factory) -> Iterator[PlatformProcesses]:
    """A frontend of the module's own in front of the session's worker pool; its tenants are
    the module's own, so their cache salts keep the other tests' prompts out of their overlap."""
    processes = PlatformProcesses.joining(
        worker_pool.processes,
        tmp_path_factory.mktemp("tenants"),
        worker_pool.fresh_tenant_key(),
        # Small answers keep the schemathesis run short; the schema says so (its max_tokens bound).
        {"MAX_TOKENS_LIMIT": "8", "LOG_LEVEL": "DEBUG", "LOG_LEVELS": "routing=debug"},
    )
    ISSUED_KEYS.append(processes.api_key)
    try:
        processes.start_server()
        yield processes
    finally:
        processes.close()


def keys(platform: PlatformProcesses, *specs: dict) -> list[str]:
    made = platform.make_keys(*specs)
    ISSUED_KEYS.extend(made)
    return made


def client(platform: PlatformProcesses, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{platform.base_url}/v1", api_key=key, max_retries=0)


def ask(platform: PlatformProcesses, key: str, text: str, **extra) -> httpx.Response:
    body = {"model": "demo", "messages": [{"role": "user", "content": text}], "max_tokens": 2, **extra}
    response = httpx.post(
        f"{platform.base_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return response


def cached(response: httpx.Response) -> tuple[int, int]:
    """(cached prompt tokens, overlap blocks the router saw) of an answer."""
    overlap = int(response.headers["X-Routing-Overlap"].split("/")[0])
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"], overlap


def test_the_openai_client_needs_a_valid_key_and_loses_it_when_revoked(platform):
    # given a tenant's key
    (key,) = keys(platform, {"tenant": "acme"})
    acme = client(platform, key)

    # then it serves chat and models, and a model can be retrieved by id
    answer = acme.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=4
    )
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert acme.models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        acme.models.retrieve("gpt-17")

    # a wrong key, or one that merely looks right, is refused
    for wrong in ("sk-anything", key[:-4] + "AAAA"):
        with pytest.raises(openai.AuthenticationError) as refused:
            client(platform, wrong).models.list()
        assert refused.value.status_code == 401
    # and so is a request without any key (the client insists on one: send it bare)
    bare = httpx.get(f"{platform.base_url}/v1/models", timeout=10)
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "missing_api_key"

    # when the key is revoked from the command line, the next call is refused
    platform.manage("api_keys", "revoke", key.split(".")[0])
    with pytest.raises(openai.AuthenticationError) as revoked:
        acme.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert "revoked" in revoked.value.message


def test_over_the_limit_the_client_gets_a_rate_limit_error_with_retry_after(platform):
    (key,) = keys(platform, {"tenant": "thrifty", "requests_per_minute": 2})
    thrifty = client(platform, key)
    for _ in range(2):
        thrifty.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    with pytest.raises(openai.RateLimitError) as limited:
        thrifty.chat.completions.create(
            model="demo", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    assert limited.value.code == "rate_limit_exceeded"
    assert 1 <= int(limited.value.response.headers["Retry-After"]) <= 60
    assert limited.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    # another tenant is not held back by this one's limit
    (other,) = keys(platform, {"tenant": "unrelated"})
    assert client(platform, other).models.list().data


def test_answers_carry_openais_ratelimit_headers_where_the_tenant_has_limits(platform):
    limited, unlimited = keys(
        platform,
        {"tenant": "metered", "requests_per_minute": 5, "prompt_tokens_per_minute": 10_000},
        {"tenant": "boundless"},
    )
    answer = ask(platform, limited, "Hi")
    prompt_tokens = answer.json()["usage"]["prompt_tokens"]
    assert answer.headers["x-ratelimit-limit-requests"] == "5"
    assert answer.headers["x-ratelimit-remaining-requests"] == "4"
    assert answer.headers["x-ratelimit-limit-tokens"] == "10000"
    assert answer.headers["x-ratelimit-remaining-tokens"] == str(10_000 - prompt_tokens)
    assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
    # a stream's answer carries them too, and a tenant without limits gets none
    streamed = ask(platform, limited, "Hi", stream=True)
    # (3 left, or 4 if the bucket refilled one request, 12 s at 5 a minute, since the first)
    assert streamed.headers["x-ratelimit-remaining-requests"] in ("3", "4")
    assert not any(name.startswith("x-ratelimit") for name in ask(platform, unlimited, "Hi").headers)


def test_a_completion_carries_logprobs_when_asked(platform):
    (key,) = keys(platform, {"tenant": "analyst"})
    answer = client(platform, key).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Name a river."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens >= 1
    assert "".join(entry.token for entry in content).startswith(answer.choices[0].message.content or "")
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.logprob - 1e-6  # temperature 0 takes the best
    streamed = client(platform, key).chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Name a river."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    texts = [choice for choice in chunks if choice.delta.content]
    # As OpenAI streams them: each content chunk carries its own tokens' entries, not the last one.
    assert all(choice.logprobs and choice.logprobs.content for choice in texts)
    assert "".join(choice.delta.content for choice in texts) == answer.choices[0].message.content
    for choice in texts:
        tokens = "".join(entry.token for entry in choice.logprobs.content)
        if "\ufffd" not in tokens:  # a token of part of a character shows as U+FFFD on its own
            assert tokens == choice.delta.content
    joined = [entry for choice in chunks if choice.logprobs for entry in choice.logprobs.content]
    assert len(texts) > 1 or len(joined) == 1
    # Joined in order, the streamed entries are the non-streamed ones of the same greedy request.
    assert [(e.token, e.bytes) for e in joined] == [(e.token, e.bytes) for e in content]
    assert [e.logprob for e in joined] == pytest.approx([e.logprob for e in content], abs=1e-4)
    assert [[t.token for t in e.top_logprobs] for e in joined] == [
        [t.token for t in e.top_logprobs] for e in content
    ]


def test_a_second_tenant_can_probe_nothing_of_the_first_tenants_prompts(platform):
    # given tenant "alice" sent a prompt holding a secret, and her cache holds it
    alice, alice_laptop, bob, mallory = keys(
        platform, {"tenant": "alice"}, {"tenant": "alice"}, {"tenant": "bob"}, {"tenant": "mallory"}
    )
    ask(platform, alice, SECRET_PROMPT)
    again = ask(platform, alice, SECRET_PROMPT)
    assert cached(again)[0] > 0 and cached(again)[1] > 0, "the prompt is cached for its tenant"
    # and keys of one tenant share freely
    assert cached(ask(platform, alice_laptop, SECRET_PROMPT))[0] > 0

    # when tenant "bob" guesses the exact prompt, and tenant "mallory" a near miss (each in a
    # tenant of its own: a tenant's second guess would rightly reuse its own first)
    exact = ask(platform, bob, SECRET_PROMPT)
    near = ask(platform, mallory, SECRET_PROMPT.replace("7341", "7342"))

    # then he sees no cached tokens and no overlap, in the answer or its headers
    assert cached(exact) == (0, 0)
    assert cached(near) == (0, 0)
    # and /v1/route is not his to call
    body = {"model": "demo", "messages": [{"role": "user", "content": SECRET_PROMPT}]}
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=body, headers={"Authorization": f"Bearer {bob}"}, timeout=30
    )
    assert route.status_code == 403
    # an operator of another tenant sees the router's view in the operator's own partition
    (operator,) = keys(platform, {"tenant": "ops", "staff": True})
    seen = httpx.post(
        f"{platform.base_url}/v1/route",
        json=body,
        headers={"Authorization": f"Bearer {operator}"},
        timeout=30,
    ).json()
    # (the pool's live workers; rows of workers other tests started and stopped are not eligible)
    eligible = [candidate for candidate in seen["candidates"] if candidate["eligible"]]
    assert eligible and {candidate["overlap"] for candidate in eligible} == {0}


def test_two_tenants_that_opted_into_sharing_share_one_pool(platform):
    carol, dave, erin = keys(
        platform,
        {"tenant": "carol", "share_prefix_cache": True},
        {"tenant": "dave", "share_prefix_cache": True},
        {"tenant": "erin"},
    )
    prompt = "Shared system guidance for every team: " + SECRET_PROMPT.replace("secret", "common")
    ask(platform, carol, prompt)
    assert cached(ask(platform, dave, prompt))[0] > 0
    assert cached(ask(platform, erin, prompt)) == (0, 0), "a tenant that did not opt in shares nothing"


def test_schemathesis_finds_no_server_error_and_no_schema_violation(platform):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from openapi_schema_validator import OAS30Validator
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{platform.base_url}/v1/openapi.json")
    document = httpx.get(f"{platform.base_url}/v1/openapi.json", timeout=10).json()
    # Each streamed event's JSON payload: a chunk, or an error after the stream began.
    chunk_or_error = OAS30Validator(
        {
            "oneOf": [
                {"$ref": "#/components/schemas/ChatCompletionChunk"},
                {"$ref": "#/components/schemas/Error"},
            ],
            "components": document["components"],
        }
    )
    streamed: list[int] = []

    def check_stream(response) -> None:
        events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            chunk_or_error.validate(json.loads(event))
        streamed.append(len(events))

    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_schema_conformance,
    ]
    # Chat cases run the model (about a tenth of a second each here); the others are cheap.
    # Operations without inputs (health, ready) give hypothesis one distinct case only.
    budget = {
        "createChatCompletion": 110,
        "listModels": 20,
        "retrieveModel": 175,
        "health": 5,
        "ready": 5,
        "route": 30,  # the operators' endpoints: the platform's key is a staff key
        "metrics": 3,
    }
    calls: dict[str, int] = {}
    statuses: dict[int, int] = {}
    spent: dict[str, float] = {}

    def fuzz(operation, name: str) -> None:
        @settings(
            max_examples=budget[name],
            deadline=None,
            database=None,
            derandomize=True,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy())
        def run(case) -> None:
            started = time.perf_counter()
            response = case.call(base_url=platform.base_url, headers=platform.headers, timeout=60)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
            calls[name] = calls.get(name, 0) + 1
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=checks)
            content_type = response.headers.get("content-type") or [""]  # schemathesis: lists of values
            if content_type[0].startswith("text/event-stream"):
                check_stream(response)

        run()

    for result in schema.get_all_operations():
        operation = result.ok()
        fuzz(operation, operation.definition.raw["operationId"])
    print("schemathesis cases", calls, "seconds", {k: round(v, 1) for k, v in spent.items()}, statuses)
    assert sum(calls.values()) >= 300, calls
    assert streamed, "some generated requests streamed, and every chunk fit the schema"
    assert set(calls) == set(budget)
    assert statuses.get(200, 0) >= 40, statuses  # the generated requests were mostly served, not refused
    assert not any(status >= 500 for status in statuses), statuses


def test_no_key_appears_in_the_clear_in_logs_redis_or_the_database(platform):
    # given every key this module issued, used and refused above
    assert len(ISSUED_KEYS) >= 10
    secrets = [key for key in ISSUED_KEYS] + [key.split(".", 1)[1] for key in ISSUED_KEYS]

    # then no log of the server or the worker holds one
    logs = platform.log("server") + "".join(platform.log(f"worker-{name}") for name in POOL_WORKERS)
    assert "request" in logs  # the logs are there, and were written at debug level
    # nor any key or value in Redis under the platform's namespace
    conn = redis.Redis.from_url(TEST_REDIS_URL)
    stored = []
    for key in conn.scan_iter(match=f"{platform.namespace}*", count=1000):
        kind = conn.type(key)
        if kind == b"string":
            stored.append(conn.get(key) or b"")
        elif kind == b"hash":
            stored.extend(f"{k!r}{v!r}".encode() for k, v in conn.hgetall(key).items())
        elif kind == b"list":
            stored.extend(conn.lrange(key, 0, -1))
        elif kind == b"zset":
            stored.extend(member for member, _ in conn.zrange(key, 0, -1, withscores=True))
        elif kind == b"set":
            stored.extend(conn.smembers(key))
        elif kind == b"stream":
            stored.extend(repr(entry).encode() for entry in conn.xrange(key))
        stored.append(key)
    conn.close()
    redis_text = b"\n".join(stored).decode("latin-1")
    database = Path(platform.env["DATABASE_URL"].removeprefix("sqlite:///")).read_bytes().decode("latin-1")
    for secret in secrets:
        assert secret not in logs
        assert secret not in redis_text
        assert secret not in database
    # while the public prefixes are there to say which key did what
    assert any(key.split(".")[0].removeprefix("sk-") in database for key in ISSUED_KEYS)
