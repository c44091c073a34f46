"""Two models behind one endpoint, two workers each, and a frontend that cannot see either model's
directory (issue 37's acceptance), through the official `openai` client.

The Qwen2-VL worker that first serves the prompt is a real process with the model, whose block
hashes must be the frontend's own (made from the model card it published); the other Qwen2-VL
worker and the LLaVA workers are simulated ones of their checkpoints (`run_worker --engine sim`:
the card, no weights; LLaVA's two in one process), since what the test asks of them is routing:
which model, which worker, which credit. The simulated Qwen2-VL worker starts once the real one
has served the prompt (a simulated worker caches the router's own hashes, so its hits would prove
nothing of them), and before the repeat, which the router must send back to the real one."""

from __future__ import annotations

import re
import time

import httpx
import pytest

QWEN = "demo"  # the Qwen2-VL demo checkpoint's directory name: what its worker announces
LLAVA = "llava-1.5-tiny"
QWEN_WORKERS = ("qwen_a", "qwen_b")
REAL_QWEN, SIMULATED_QWEN = QWEN_WORKERS  # with the model; simulated, started after the first answer
LLAVA_PROCESS = "llava"  # one simulated process: LLAVA_WORKERS
LLAVA_WORKERS = ("llava-0", "llava-1")
ADMIN_USER, ADMIN_PASSWORD = "operator", "operator-pw-7c2a"  # a throwaway login in the test's SQLite
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

    # given workers of each model (a second Qwen one below), and a frontend without their directories
    platform = platform_processes()
    platform.start_worker(REAL_QWEN)  # MODEL_PATH: the Qwen2-VL demo
    llava = ("--model-path", str(llava_demo_dir("llava")))
    assert tuple(platform.start_sim_workers(LLAVA_PROCESS, len(LLAVA_WORKERS), *llava)) == LLAVA_WORKERS
    platform.make_superuser(ADMIN_USER, ADMIN_PASSWORD)  # while the workers load
    platform.wait_for_workers(REAL_QWEN, *LLAVA_WORKERS)
    base_url = platform.start_server(
        MODEL_PATH=str(tmp_path / "not-here"), MODEL_CARD_DIR=str(tmp_path / "cards")
    )
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key=platform.api_key, max_retries=0)

    # then the client sees both models
    assert sorted(model.id for model in client.models.list()) == [QWEN, LLAVA]
    assert client.models.retrieve(LLAVA).id == LLAVA

    # and each request lands on a worker of its model, the frontend's block hashes the worker's own
    first, headers = _ask(client, QWEN)
    held = headers["x-routed-worker"]  # the Qwen worker that now holds the prompt's blocks
    assert held == REAL_QWEN and first.choices[0].message.content
    # (the second Qwen worker, idle: a candidate the repeat must pass over)
    assert platform.start_sim_workers(SIMULATED_QWEN, 1) == [SIMULATED_QWEN]
    platform.wait_for_workers(SIMULATED_QWEN)
    route = httpx.post(
        f"{base_url}/v1/route",
        json={"model": QWEN, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4},
        headers=platform.headers,
        timeout=30,
    ).json()
    assert sorted(candidate["worker"] for candidate in route["candidates"]) == list(QWEN_WORKERS), route
    again, headers = _ask(client, QWEN)
    assert headers["x-routed-worker"] == held and _overlap(headers) > 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    _, headers = _ask(client, LLAVA)
    assert headers["x-routed-worker"] in LLAVA_WORKERS

    # when an operator puts both models behind one alias, 3 to 1 (a canary)
    platform.manage(
        "shell",
        "-c",
        "from routing.models import Model; "
        f"Model.objects.get(name={QWEN!r}).aliases.create(name='vlm', weight=3); "
        f"Model.objects.get(name={LLAVA!r}).aliases.create(name='vlm', weight=1)",
    )
    # then the alias's requests split in that ratio, each on a worker of the model it went to
    served = []
    for _ in range(8):
        _, headers = _ask(client, "vlm")
        served.append(headers["x-served-model"])
        assert headers["x-routed-worker"] in {QWEN: QWEN_WORKERS, LLAVA: LLAVA_WORKERS}[served[-1]]
    assert served.count(QWEN) == 6 and served.count(LLAVA) == 2
    assert "vlm" in [model.id for model in client.models.list()]

    # and /metrics counts each model's requests under its name (recorders flush about once a second)
    deadline = time.monotonic() + 15
    wanted = f'mmr_requests_total{{model="{LLAVA}",status="200",'
    while wanted not in (exposition := _metrics(base_url, platform.headers)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert wanted in exposition
    assert f'mmr_model_live_workers{{model="{QWEN}"}} 2.0' in exposition

    # when LLaVA's workers stop: 503 for LLaVA, naming it, while Qwen keeps answering
    platform.stop_worker(LLAVA_PROCESS)
    with pytest.raises(openai.APIStatusError) as unavailable:
        _ask(client, LLAVA)
    assert unavailable.value.status_code == 503 and LLAVA in unavailable.value.message
    assert _ask(client, QWEN)[1]["x-routed-worker"] in QWEN_WORKERS

    # when the Qwen worker that held the prompt restarts under its name serving LLaVA: it gets no
    # credit for the blocks it held for Qwen
    platform.stop_worker(held)
    platform.start_sim_workers(held, 1, *llava)
    platform.wait_for_workers(held)
    _, headers = _ask(client, LLAVA)
    assert headers["x-routed-worker"] == held and _overlap(headers) == 0
    assert sorted(model.id for model in client.models.list()) == [QWEN, LLAVA, "vlm"]

    # when an operator disables LLaVA in the admin (the models list's action): 404 model_not_found
    admin = platform.staff_session(ADMIN_USER, ADMIN_PASSWORD, base_url)
    listing = admin.get("/admin/routing/model/")
    (pk,) = re.findall(rf'href="/admin/routing/model/(\d+)/change/[^"]*">{re.escape(LLAVA)}<', listing.text)
    token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', listing.text)[1]
    done = admin.post(
        "/admin/routing/model/",
        data={"action": "disable", "_selected_action": pk, "index": "0", "csrfmiddlewaretoken": token},
    )
    assert done.status_code == 302, done.text[:500]
    with pytest.raises(openai.NotFoundError) as disabled:
        _ask(client, LLAVA)
    assert disabled.value.code == "model_not_found"
    # while Qwen, and the alias (now Qwen alone), keep answering
    assert _ask(client, QWEN)[1]["x-routed-worker"] in QWEN_WORKERS
    assert _ask(client, "vlm")[1]["x-served-model"] == QWEN
