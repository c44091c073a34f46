"""Two models behind one endpoint, with real worker processes and a frontend that cannot see either
model's directory (issue 37's acceptance). One worker per model: worker processes cost about 8 s
each on the test machine, and one per model proves the pool choice as two would."""

from __future__ import annotations

import time

import httpx
import pytest

QWEN = "demo"  # the Qwen2-VL demo checkpoint's directory name: what its worker announces
LLAVA = "llava-1.5-tiny"
PROMPT = "Tell me, slowly and in some detail, how the tide comes in over a wide sandy bay at dusk."


def _ask(client, model: str):
    """The answer and the response's headers (which worker, how much of the prompt it held)."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=4, temperature=0
    )
    return raw.parse(), raw.headers


def _metrics(base_url: str, headers) -> str:
    return httpx.get(f"{base_url}/metrics", headers=headers, timeout=10).text


def _overlap(headers) -> int:
    return int(headers["x-routing-overlap"].split("/")[0])


def test_two_models_each_answered_by_its_own_pool_through_the_openai_client(
    platform_processes, llava_demo_dir, tmp_path
):
    import openai

    # given a worker of each model, and a frontend without their directories
    platform = platform_processes()
    platform.start_worker("qwen_w")  # MODEL_PATH: the Qwen2-VL demo
    platform.start_worker("llava_w", "--model-path", str(llava_demo_dir("llava")))
    platform.wait_for_workers("qwen_w", "llava_w")
    base_url = platform.start_server(
        MODEL_PATH=str(tmp_path / "not-here"), MODEL_CARD_DIR=str(tmp_path / "cards")
    )
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=platform.api_key, max_retries=0)

    # then the client sees both models
    assert sorted(model.id for model in client.models.list()) == [QWEN, LLAVA]
    assert client.models.retrieve(LLAVA).id == LLAVA

    # and each request lands on a worker of its model, the frontend's block hashes the worker's own
    first, headers = _ask(client, QWEN)
    assert headers["x-routed-worker"] == "qwen_w" and first.choices[0].message.content
    again, headers = _ask(client, QWEN)
    assert headers["x-routed-worker"] == "qwen_w" and _overlap(headers) > 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    _, headers = _ask(client, LLAVA)
    assert headers["x-routed-worker"] == "llava_w"

    # when an operator puts both models behind one alias, evenly: each request goes to one of them,
    # on that model's worker (the ratio itself: tests/test_models.py)
    platform.manage(
        "shell",
        "-c",
        "from routing.models import Model; "
        f"[Model.objects.get(name=n).aliases.create(name='vlm', weight=1) for n in ({QWEN!r}, {LLAVA!r})]",
    )
    served = []
    for _ in range(12):
        _, headers = _ask(client, "vlm")
        served.append(headers["x-served-model"])
        assert headers["x-routed-worker"] == {QWEN: "qwen_w", LLAVA: "llava_w"}[served[-1]]
    assert set(served) == {QWEN, LLAVA}
    assert "vlm" in [model.id for model in client.models.list()]

    # and /metrics counts each model's requests under its name (recorders flush about once a second)
    deadline = time.monotonic() + 15
    wanted = f'mmr_requests_total{{model="{LLAVA}",status="200",worker="llava_w"}}'
    while wanted not in (exposition := _metrics(base_url, platform.headers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert wanted in exposition
    assert f'mmr_model_live_workers{{model="{QWEN}"}} 1.0' in exposition

    # when the LLaVA worker stops: 503 for LLaVA, naming it, while Qwen keeps answering
    platform.stop_worker("llava_w")
    with pytest.raises(openai.APIStatusError) as unavailable:
        _ask(client, LLAVA)
    assert unavailable.value.status_code == 503 and LLAVA in unavailable.value.message
    assert _ask(client, QWEN)[1]["x-routed-worker"] == "qwen_w"

    # when the Qwen worker restarts under its name serving LLaVA: no credit for Qwen's blocks
    platform.stop_worker("qwen_w")
    platform.start_worker("qwen_w", "--model-path", str(llava_demo_dir("llava")))
    platform.wait_for_workers("qwen_w")
    _, headers = _ask(client, LLAVA)
    assert headers["x-routed-worker"] == "qwen_w" and _overlap(headers) == 0
    assert sorted(model.id for model in client.models.list()) == [LLAVA, "vlm"]

    # when an operator disables LLaVA (the admin's action): 404 model_not_found
    platform.manage(
        "shell",
        "-c",
        f"from routing.models import Model; Model.objects.filter(name={LLAVA!r}).update(enabled=False)",
    )
    with pytest.raises(openai.NotFoundError) as disabled:
        _ask(client, LLAVA)
    assert disabled.value.code == "model_not_found"
