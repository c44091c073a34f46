"""A property-based fuzzer against the live server: whatever a client sends to
`/v1/chat/completions` or `/v1/route`, the answer is never a 500 or a 502, and every error is in
OpenAI's format. A share of the bodies is valid enough to reach the model (small max_tokens), so
the generation path is fuzzed too, not only the validation in front of it.
"""

from __future__ import annotations

import base64
import io
import json
from collections import Counter

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from PIL import Image

CHAT_EXAMPLES = 360
ROUTE_EXAMPLES = 160
# The share of the bodies that must get past validation (1 / REACHED). `derandomize` fixes the
# seed, not the bodies: Hypothesis also draws constants it finds in the project's modules loaded
# in the process (hypothesis.internal.conjecture.providers), so a run of this file alone draws
# other bodies than the suite's run. Measured: 19% to 27% got through (31 of 160 routed in a run
# of the file alone, against a fifth asked before); an eighth leaves room for the draw.
REACHED = 8


def _png(width: int, height: int) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (width % 256, height % 256, 90)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


SMALL_IMAGES = [_png(28, 28), _png(64, 40), _png(100, 30)]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=12,
)
text = st.text(max_size=60)
image_urls = st.sampled_from(SMALL_IMAGES) | st.sampled_from(
    [
        "data:image/png;base64,!!!notbase64",
        "data:text/plain;base64,aGVsbG8=",
        "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + b"\0" * 40).decode(),
        "ftp://example.com/a.png",
        "http://127.0.0.1:9/closed.png",
        "http://169.254.169.254/latest/meta-data",
        "not a url",
        "",
    ]
)
parts = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": text}),
    st.fixed_dictionaries(
        {"type": st.just("image_url"), "image_url": st.fixed_dictionaries({"url": image_urls})}
    ),
    st.fixed_dictionaries({"type": st.sampled_from(["input_audio", "video_url", "image", "x"])}),
    json_values,
)
valid_message = st.fixed_dictionaries(
    {"role": st.just("user"), "content": text.filter(str.strip) | st.lists(parts, min_size=1, max_size=3)}
)
any_message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "assistant", "system", "developer", "tool", "robot", None, 3]),
        "content": text | st.lists(parts, max_size=3) | json_values,
    }
)


@st.composite
def valid_bodies(draw) -> dict:
    """Bodies a real client would send: they should reach the model (a few hit a bad image)."""
    body = {
        "model": "demo",
        "messages": [draw(valid_message)],
        "max_tokens": draw(st.integers(min_value=1, max_value=3)),
    }
    if draw(st.booleans()):
        body["temperature"] = draw(st.floats(min_value=0, max_value=2))
    if draw(st.booleans()):
        body["stream"] = draw(st.booleans())
    if draw(st.booleans()):
        body["stop"] = draw(st.lists(st.text(min_size=1, max_size=4), min_size=1, max_size=2))
    if draw(st.booleans()):
        body["seed"] = draw(st.integers(min_value=0, max_value=2**31))
    return body


@st.composite
def hostile_bodies(draw) -> dict:
    """Bodies that break the rules: wrong types, wrong ranges, unknown fields, odd messages."""
    body = draw(valid_bodies())
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        field = draw(
            st.sampled_from(
                [
                    *("model", "messages", "max_tokens", "temperature", "top_p", "stream", "stop", "seed"),
                    *("n", "stream_options", "max_completion_tokens", "tools", "response_format", "logprobs"),
                ]
            )
        )
        if field == "messages":
            body["messages"] = draw(st.lists(any_message, max_size=3) | json_values)
        else:
            body[field] = draw(json_values)
    if draw(st.booleans()):
        del body[draw(st.sampled_from(sorted(body)))]
    return body


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.just(b"[" * 2000 + b"]" * 2000),
    st.just(b'{"model": "demo", "messages": ' + b"[" * 1200),
    json_values.map(lambda value: json.dumps(value).encode()),
)
requests = st.one_of(
    valid_bodies().map(lambda body: ("json", body)),
    valid_bodies().map(lambda body: ("json", body)),
    hostile_bodies().map(lambda body: ("json", body)),
    raw_bodies.map(lambda raw: ("raw", raw)),
)


def assert_answer_is_sound(response: httpx.Response, path: str) -> None:
    assert response.status_code not in (500, 502), f"{path}: {response.status_code} {response.text[:400]}"
    if response.status_code >= 400:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert body["error"]["message"] and body["error"]["type"]
        return
    assert response.status_code == 200
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        for event in events[:-1]:
            payload = json.loads(event)
            assert "choices" in payload or "error" in payload or "usage" in payload, payload
    else:
        response.json()


@pytest.fixture(scope="module")
def api(shared_platform):
    with httpx.Client(
        base_url=shared_platform.base_url, headers=shared_platform.headers, timeout=60
    ) as client:
        yield client


def send(api: httpx.Client, path: str, request: tuple[str, object]) -> httpx.Response:
    kind, body = request
    if kind == "json":
        return api.post(path, json=body)
    return api.post(path, content=body, headers={"Content-Type": "application/json"})


fuzz_settings = settings(
    deadline=None,
    database=None,
    derandomize=True,  # the same bodies each run: a failure here reproduces
    phases=[Phase.generate],
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.function_scoped_fixture,
    ],
)


def test_fuzzed_chat_completions_never_answer_500_or_502(api):
    outcomes: Counter[str] = Counter()

    @settings(fuzz_settings, max_examples=CHAT_EXAMPLES)
    @given(request=requests)
    def one(request) -> None:
        response = send(api, "/v1/chat/completions", request)
        assert_answer_is_sound(response, "/v1/chat/completions")
        outcomes["sent"] += 1
        outcomes["generated" if response.status_code == 200 else str(response.status_code)] += 1

    one()
    assert outcomes["sent"] >= CHAT_EXAMPLES * 0.95
    print("chat/completions outcomes:", dict(outcomes))
    # an eighth or more of the bodies went through the model, not only through validation
    assert outcomes["generated"] >= outcomes["sent"] / REACHED, outcomes


def test_fuzzed_route_requests_never_answer_500_or_502(api):
    outcomes: Counter[str] = Counter()

    @settings(fuzz_settings, max_examples=ROUTE_EXAMPLES)
    @given(request=requests)
    def one(request) -> None:
        response = send(api, "/v1/route", request)
        assert_answer_is_sound(response, "/v1/route")
        outcomes["sent"] += 1
        outcomes[str(response.status_code)] += 1

    one()
    assert outcomes["sent"] >= ROUTE_EXAMPLES * 0.95
    print("route outcomes:", dict(outcomes))
    assert outcomes["200"] >= outcomes["sent"] / REACHED, outcomes


def test_a_body_over_the_limit_is_a_413_on_the_live_server_and_one_under_it_is_served(shared_platform, api):
    # given the shared platform's 4 MiB limit: a 3 MB data URL image fits, a 5 MB body does not
    big = io.BytesIO()
    Image.effect_noise((1000, 800), 80).convert("RGB").save(big, "BMP")  # 2.4 MB, 3.2 MB as base64
    data_url = "data:image/bmp;base64," + base64.b64encode(big.getvalue()).decode()
    body = {
        "model": "demo",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url}}]}],
    }
    served = api.post("/v1/chat/completions", json=body)
    assert served.status_code == 200, served.text[:300]
    body["messages"].append({"role": "user", "content": "x" * 2_000_000})
    refused = api.post("/v1/chat/completions", json=body)
    assert refused.status_code == 413
    assert refused.json()["error"]["code"] == "request_too_large"
