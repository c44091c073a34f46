"""Workers on vLLM (`run_worker --engine vllm`), end to end: the platform's frontend routes, a
vLLM worker answers from its AsyncLLM, and the answer's cached tokens are vLLM's own. Requests go
through the official `openai` client, as the platform's users send them.

These need vLLM's virtualenv (`make vllm`, 3.3 GB); without it they are skipped, saying so
(`make test` and `make test-vllm` build it first). vLLM starts in 40-80 s on a 2-core machine, so the
module starts one pair of vLLM workers (`vllm_pair`) that every test which only sends requests
shares, each with pictures of its own; last come the Redis restart, which empties everything,
and a worker killed before its requests' first token, which leaves one.
Only the Qwen3-VL checkpoint starts a worker of its own (what a vLLM worker refuses before
anything loads is tested in process: tests/test_vllm_worker_env.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from PIL import Image

from routing.fleet.registry import Heartbeat
from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from tests.image_server import ImageServer
from tests.platform_harness import PrivateRedis
from tests.test_faults import set_enabled
from tests.test_routing_end_to_end import route_until_overlap
from tests.video_files import make_clip

VLLM_PYTHON = Path(__file__).resolve().parent.parent / ".venv-vllm" / "bin" / "python"
PAIR = ("va", "vb")

pytestmark = [
    pytest.mark.integration,
    pytest.mark.vllm,
    pytest.mark.timeout(600),
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason="no .venv-vllm: run `make vllm` to test vLLM workers"
    ),
]

# vLLM's CPU attention takes blocks of 32 tokens; the router must hash in the same blocks.
VLLM_ENV = {
    "KV_BLOCK_SIZE": "32",
    "VLLM_KV_CACHE_MB": "64",
    "MEDIA_ALLOWED_HOSTS": "127.0.0.1",
    "WORKER_HEARTBEAT_TTL_SECS": "5",
    "WORKER_HEARTBEAT_INTERVAL_SECS": "1",
    "LOG_LEVELS": "workers.vllm_engine=debug",
    # The worker fetches every image again (no decoded-image cache keyed on the URL), so a URL
    # whose pixels changed reaches vLLM with its new pixels.
    "IMAGE_LOCAL_CACHE_ENTRIES": "0",
}


def picture(seed: int, size: tuple[int, int] = (336, 280)) -> bytes:
    buffer = io.BytesIO()
    Image.effect_noise(size, 40 + seed).convert("RGB").save(buffer, format="PNG")
    return buffer.getvalue()


def image_request(url: str, question: str = "Describe this image.", **fields) -> dict:
    return {
        "model": "demo",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": question},
                    {"type": "image_url", "image_url": {"url": url}},
                ],
            }
        ],
        "max_tokens": 8,
        "temperature": 0,
        **fields,
    }


@pytest.fixture
def origin():
    with ImageServer() as server:
        yield server


# --- workers of their own, before the pair starts -------------------------------------------------
def test_the_vllm_virtualenv_imports_torchvision_for_qwen2_vls_image_processor() -> None:
    done = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import torchvision; from transformers import Qwen2VLImageProcessor"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_qwen3_vl_vllm_worker_answers_the_same_image_and_video_from_its_cache(
    platform_processes, qwen3_demo_dir, origin
):
    # given a vLLM worker serving the Qwen3-VL demo checkpoint
    platform = platform_processes(**VLLM_ENV, MODEL_PATH=str(qwen3_demo_dir), MODEL_NAME="demo")
    platform.start_worker("q3", "--engine", "vllm", "--threads", "1", python=str(VLLM_PYTHON))
    platform.wait_for_workers("q3", timeout=400)
    platform.start_server()
    url = origin.add("/q3.png", picture(9), content_type="image/png")

    # when the same image comes twice
    first = chat(platform, image_request(url))
    second = chat(platform, image_request(url))

    # then vLLM laid it out as the router did (checked on both), and reused the image's blocks
    assert first.status_code == second.status_code == 200, first.text + platform.log_tail("worker-q3")
    assert len(re.findall(r"vLLM's layout agrees with the router's", platform.log("worker-q3"))) == 2
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64

    # and a clip, which Qwen3-VL lays out with a timestamp before each group of frames, is
    # expanded by vLLM as the router did (checked on both), its blocks cached the second time
    clip = origin.add(
        "/q3.mp4", make_clip(frames=48, width=160, height=120, fps=12), content_type="video/mp4"
    )
    asked = video_request(clip, "What happens in this clip?")
    first = chat(platform, asked)
    second = chat(platform, asked)
    assert first.status_code == second.status_code == 200, first.text + platform.log_tail("worker-q3")
    assert len(re.findall(r"vLLM's layout agrees with the router's", platform.log("worker-q3"))) == 4
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


# --- the pair: every test's pictures are its own -----------------------------------------------------
@pytest.fixture(scope="module")
def pair_redis(tmp_path_factory: pytest.TempPathFactory):
    """The pair's Redis, a server of the module's own: the restart test empties it."""
    server = PrivateRedis(tmp_path_factory.mktemp("vllm-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_pair(platform_harness, tmp_path_factory: pytest.TempPathFactory, demo_model_dir: Path, pair_redis):
    """Two vLLM workers (one OpenMP thread each) and a frontend, shared by the tests that only
    send requests."""
    platform = platform_harness(
        tmp_path_factory.mktemp("vllm-pair"), demo_model_dir, pair_redis.url, "test:vllm:", VLLM_ENV
    )
    try:
        for name in PAIR:
            platform.start_worker(name, "--engine", "vllm", "--threads", "1", python=str(VLLM_PYTHON))
        platform.wait_for_workers(*PAIR, timeout=500)
        platform.start_server()
        yield platform
    finally:
        platform.close()


def client(platform) -> openai.OpenAI:
    """The official `openai` client, as the platform's users send their requests."""
    return openai.OpenAI(
        base_url=f"{platform.base_url}/v1", api_key=platform.api_key, max_retries=0, timeout=120
    )


def chat(platform, request: dict) -> httpx.Response:
    """The request sent by the `openai` client; its HTTP response, read, whatever its status (the
    headers say which worker answered and the router's overlap)."""
    try:
        raw = client(platform).chat.completions.with_raw_response.create(**request)
    except openai.APIStatusError as error:
        return error.response
    response = raw.http_response
    response.read()
    return response


def layout_checks(platform, worker: str) -> int:
    """How many requests the worker checked vLLM's expanded prompt against the router's blocks for."""
    return len(
        re.findall(r"vLLM's layout agrees with the router's on \d+ blocks", platform.log(f"worker-{worker}"))
    )


def test_the_seed_example_across_two_vllm_workers(vllm_pair, origin) -> None:
    # given two vLLM workers behind the router, and an image at its origin
    platform = vllm_pair
    url = origin.add("/seed.png", picture(1), content_type="image/png")
    checked = {name: layout_checks(platform, name) for name in PAIR}

    # when the same image and question come twice
    first = chat(platform, image_request(url))
    second = chat(platform, image_request(url))

    # then vLLM answered both, the same way, and the second went back to the worker that served
    # the first: the router saw the overlap (from that worker's KV events), and vLLM reused at
    # least the 336x280 image's 3 full blocks of 32 (120 placeholders), as vLLM counts them
    assert first.status_code == 200, first.text + platform.log_tail("worker-va")
    assert second.status_code == 200, second.text
    worker = first.headers["X-Routed-Worker"]
    assert second.headers["X-Routed-Worker"] == worker
    overlap, total = (int(n) for n in second.headers["X-Routing-Overlap"].split("/"))
    assert overlap >= 3 and total >= overlap
    first_body, second_body = first.json(), second.json()
    assert first_body["choices"][0]["message"]["content"] == second_body["choices"][0]["message"]["content"]
    assert first_body["usage"]["prompt_tokens"] == second_body["usage"]["prompt_tokens"] > 120
    # the image starts in the prompt's first block: nothing of the first was cached
    assert first_body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert second_body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    # and vLLM's expanded prompt hashed to the router's blocks, checked on both requests
    assert layout_checks(platform, worker) == checked[worker] + 2
    # and the worker's heartbeat carries the prefill rate vLLM's steps measured (the router drains
    # the prefill it reserved there at that rate)
    deadline = time.monotonic() + 10
    while not Heartbeat.from_json(platform.redis.get(platform.heartbeat_key(worker))).prefill_tokens_per_s:
        assert time.monotonic() < deadline, "no prefill rate in the heartbeat"
        time.sleep(0.2)
    assert "Iteration(" not in platform.log(f"worker-{worker}")  # vLLM's per-step lines, dropped


def find_block_hashes(description: object) -> list[int] | None:
    """The token view's block hashes, wherever `/v1/route` puts them."""
    if isinstance(description, dict):
        if "block_hashes" in description:
            return [int(h) for h in description["block_hashes"]]
        for value in description.values():
            found = find_block_hashes(value)
            if found is not None:
                return found
    return None


def test_vllms_kv_events_put_the_prompts_blocks_in_the_routers_index(vllm_pair, origin) -> None:
    # given a vLLM worker publishing its KV events, and the router's view of an image prompt
    platform = vllm_pair
    url = origin.add("/events.png", picture(4), content_type="image/png")
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=image_request(url), headers=platform.headers, timeout=60
    )
    assert route.status_code == 200, route.text
    hashes = find_block_hashes(route.json())
    assert hashes and len(hashes) >= 4
    index = KvIndex(platform.redis, platform.namespace)
    assert not any(index.worker_blocks(name) & set(hashes) for name in PAIR)

    # when a worker answers it
    answer = chat(platform, image_request(url))
    assert answer.status_code == 200, answer.text
    worker = answer.headers["X-Routed-Worker"]

    # then the index lists every block of the prompt under that worker, by the router's own
    # hashes (translated from vLLM's, which key the image on its pixels)
    deadline = time.monotonic() + 10
    while not set(hashes) <= index.worker_blocks(worker):
        assert time.monotonic() < deadline, platform.log_tail(f"worker-{worker}")
        time.sleep(0.1)


def video_request(url: str, question: str, **fields) -> dict:
    content = [{"type": "video_url", "video_url": {"url": url}}, {"type": "text", "text": question}]
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        **fields,
    }


def test_the_same_video_twice_goes_back_to_its_vllm_worker_with_its_blocks_cached(vllm_pair, origin) -> None:
    # given a clip at an origin (the frontend fetches, decodes and samples it; the worker gets
    # its frames from the side store and hands them to vLLM with the frames' own uuid)
    platform = vllm_pair
    url = origin.add(
        "/clip.mp4", make_clip(frames=48, width=160, height=120, fps=12), content_type="video/mp4"
    )
    before = {name: layout_checks(platform, name) for name in PAIR}

    # when one question about it is answered, and the worker's KV events have reached the index
    first = chat(platform, video_request(url, "What happens in this clip?"))
    assert first.status_code == 200, first.text
    served_by = first.headers["X-Routed-Worker"]
    asked = video_request(url, "Which colours do you see?")
    choice = route_until_overlap(platform.base_url, platform.headers, asked)
    assert choice is not None, platform.log_tail(f"worker-{served_by}")
    route = httpx.post(
        f"{platform.base_url}/v1/route", json=asked, headers=platform.headers, timeout=60
    ).json()
    (video,) = route["videos"]
    video_end_block = (video["start"] + video["tokens"]) // 32

    # then the router sees the whole video in that worker's cache, from vLLM's own events
    assert video["full_blocks"] >= 2
    assert choice["worker"] == served_by and choice["overlap"] >= video_end_block

    # and another question about it goes there and finds the video's blocks in vLLM's cache,
    # vLLM having expanded the video as the router did (checked on both requests)
    second = chat(platform, asked)
    assert second.status_code == 200, second.text
    assert second.headers["X-Routed-Worker"] == served_by
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] // 32 >= video_end_block
    assert layout_checks(platform, served_by) - before[served_by] == 2


def test_the_same_url_with_new_pixels_is_not_a_false_hit_in_vllms_cache(vllm_pair, origin) -> None:
    # given an image answered once, whose origin then serves other pixels of the same size
    platform = vllm_pair
    url = origin.add("/changing.png", picture(5), content_type="image/png")
    before = chat(platform, image_request(url))
    origin.add("/changing.png", picture(6), content_type="image/png")

    # when the same URL comes again
    after = chat(platform, image_request(url))

    # then the router sent it back (same URL identity), but vLLM reused none of the old picture:
    # the image starts in the prompt's first block, so nothing at all was cached
    assert before.status_code == after.status_code == 200, after.text
    assert after.headers["X-Routed-Worker"] == before.headers["X-Routed-Worker"]
    assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # and the same new pixels once more are a hit again
    again = chat(platform, image_request(url))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96


def test_a_streamed_answer_comes_in_pieces_with_its_finish_reason_and_logprobs_come_back(
    vllm_pair, origin
) -> None:
    # given a vLLM worker and an image
    platform = vllm_pair
    url = origin.add("/stream.png", picture(2), content_type="image/png")

    # when the answer is streamed, with a length limit
    pieces, reasons = [], []
    for chunk in client(platform).chat.completions.create(**image_request(url, stream=True, max_tokens=6)):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            reasons.append(chunk.choices[0].finish_reason)

    # then the text came in several pieces, and it ended for its length
    assert sum(1 for piece in pieces if piece) >= 2
    assert reasons[-1] == "length" or "length" in reasons

    # and log probabilities come back in OpenAI's shape, one entry per token, from vLLM's
    answer = chat(platform, image_request(url, max_tokens=4, logprobs=True, top_logprobs=2))
    assert answer.status_code == 200, answer.text
    content = answer.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == answer.json()["usage"]["completion_tokens"] == 4
    for entry in content:
        assert entry["logprob"] <= 0 and len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] >= entry["logprob"] - 1e-6


def test_a_client_that_goes_away_has_its_request_aborted_in_vllm_within_a_second(vllm_pair, origin) -> None:
    # given a vLLM worker streaming a long answer
    platform = vllm_pair
    url = origin.add("/long.png", picture(3), content_type="image/png")
    request = image_request(url, stream=True, max_tokens=3000)

    # when the client reads its first piece and hangs up
    pattern = re.compile(r"request (\S+) cancelled: vLLM aborted it after (\d+) tokens")
    with client(platform).chat.completions.with_streaming_response.create(**request) as response:
        assert response.status_code == 200
        log, rid = f"worker-{response.headers['X-Routed-Worker']}", response.headers["X-Request-Id"]
        for line in response.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                break
    gone = time.monotonic()

    # then vLLM aborted this request within a second (0.2 s measured), long before its 3,000 tokens
    def aborted() -> list[int]:
        return [int(tokens) for aborted, tokens in pattern.findall(platform.log(log)) if aborted == rid]

    while not aborted():
        # the frontend's side too: whether it saw the client go and told the worker to stop
        assert time.monotonic() - gone < 10, platform.log_tail(log) + "\n" + platform.log_tail("server", 15)
        time.sleep(0.02)
    assert time.monotonic() - gone < 1.0
    assert aborted()[0] < 3000


_VLLM_DIRECTLY = """
import json, os, sys
from PIL import Image
from vllm import LLM, SamplingParams

model, image_path, question, max_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
llm = LLM(model=model, enforce_eager=True, block_size=32, kv_cache_memory_bytes=64 << 20, dtype="float32",
          max_model_len=8192, max_num_seqs=16, limit_mm_per_prompt={"image": 8, "video": 0})
messages = [{"role": "user", "content": [
    {"type": "text", "text": question},
    {"type": "image_pil", "image_pil": Image.open(image_path).convert("RGB")},
]}]
out = llm.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]
print("RESULT " + json.dumps({"text": out.outputs[0].text, "tokens": list(out.outputs[0].token_ids),
                              "prompt_tokens": len(out.prompt_token_ids)}))
"""


def test_greedy_answers_equal_vllms_own_chat_on_the_same_image(vllm_pair, origin, tmp_path) -> None:
    # given an image, answered greedily through the platform's vLLM worker (float32, alone), from
    # an empty prefix cache as a fresh LLM's
    platform = vllm_pair
    image = picture(8)
    url = origin.add("/greedy.png", image, content_type="image/png")
    platform.manage("flush_caches", "--cache", "kv")
    through_platform = chat(platform, image_request(url, max_tokens=16))
    assert through_platform.status_code == 200, through_platform.text
    assert through_platform.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    # when vLLM's own LLM.chat answers the same question about the same pixels
    path = tmp_path / "greedy.png"
    path.write_bytes(image)
    # (its engine core in the same process: one start of vLLM fewer, ~13 s of CPU here)
    env = {
        **platform.env,
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    done = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-c",
            _VLLM_DIRECTLY,
            str(platform.env["MODEL_PATH"]),
            str(path),
            "Describe this image.",
            "16",
        ],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=tmp_path,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, done.stderr[-3000:]
    direct = json.loads(lines[-1][len("RESULT ") :])

    # then the prompt had the same length and the answer is the same, token for token
    body = through_platform.json()
    assert body["usage"]["prompt_tokens"] == direct["prompt_tokens"]
    assert body["usage"]["completion_tokens"] == len(direct["tokens"])
    assert body["choices"][0]["message"]["content"] == direct["text"]


# Last but one: it empties the pair's Redis.
def test_after_redis_restarts_empty_a_repeat_shows_its_true_overlap_again(
    vllm_pair, pair_redis, origin
) -> None:
    # given an image answered once by one of the pair, whose blocks its KV events put in the index
    platform = vllm_pair
    url = origin.add("/kept.png", picture(10), content_type="image/png")
    first = chat(platform, image_request(url))
    assert first.status_code == 200, first.text
    served_by = first.headers["X-Routed-Worker"]
    cacheable = (first.json()["usage"]["prompt_tokens"] - 1) // 32  # vLLM never caches the last token

    # when Redis dies and comes back with nothing (no persistence)
    pair_redis.kill()
    pair_redis.start()

    # then within a few heartbeats (1 s here) that worker re-announced what its mirror of vLLM's
    # cache holds, and the router sees the prompt's blocks there again
    choice = route_until_overlap(platform.base_url, platform.headers, image_request(url))
    assert choice is not None, platform.log_tail(f"worker-{served_by}")
    assert choice["worker"] == served_by and choice["overlap"] >= cacheable
    assert "re-announced" in platform.log(f"worker-{served_by}")

    # and the repeat is served there, from vLLM's cache, as far as the router said, through the
    # restarted broker
    repeat = None
    for _ in range(20):
        repeat = chat(platform, image_request(url))
        if repeat.status_code == 200:
            break
        time.sleep(0.5)
    assert repeat is not None and repeat.status_code == 200, repeat.text if repeat else None
    assert repeat.headers["X-Routed-Worker"] == served_by
    overlap = int(repeat.headers["X-Routing-Overlap"].split("/")[0])
    cached = repeat.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert min(overlap, cacheable) == cached // 32 == cacheable


def streamed(platform, request: dict, on_piece=None) -> tuple[Any, list[str], str]:
    """A streamed chat's response, its pieces of content, and its whole body; `on_piece(response,
    count)` after each piece."""
    pieces: list[str] = []
    lines: list[str] = []
    with client(platform).chat.completions.with_streaming_response.create(**request) as response:
        for line in response.iter_lines():
            lines.append(line)
            if line.startswith("data: {"):
                for choice in json.loads(line[len("data: ") :]).get("choices", []):
                    if choice["delta"].get("content"):
                        pieces.append(choice["delta"]["content"])
                        if on_piece is not None:
                            on_piece(response, len(pieces))
    return response, pieces, "\n".join(lines)


# After the Redis restart: it kills the engine core of one of the pair, then starts that worker
# again for the last test.
def test_an_answer_whose_vllm_engine_core_dies_midway_is_continued_by_the_other_worker(
    vllm_pair, origin
) -> None:
    # given a long greedy answer, once unbroken
    platform = vllm_pair
    url = origin.add("/continued.png", picture(12), content_type="image/png")
    request = image_request(url, stream=True, max_tokens=160, stream_options={"include_usage": True})
    response, unbroken, body = streamed(platform, request)
    assert response.status_code == 200 and '"finish_reason":"length"' in body.replace(" ", ""), body[-500:]

    # when it is asked again and, a few pieces in, the answering worker's vLLM engine core dies
    doomed: list[str] = []

    def kill_engine_core(response: Any, pieces: int) -> None:
        if pieces == 5:
            doomed.append(response.headers["X-Routed-Worker"])
            for pid in descendants(platform.workers[doomed[0]].pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    response, pieces, body = streamed(platform, request, on_piece=kill_engine_core)

    # then the client got the whole answer, the same one, with no error: the other worker
    # continued it after the tokens it already had
    assert doomed, "the answer ended before its fifth piece"
    dead = doomed[0]
    other = next(name for name in PAIR if name != dead)
    assert response.status_code == 200
    assert '"error"' not in body and body.rstrip().endswith("data: [DONE]"), body[-800:]
    usage = [json.loads(line[6:])["usage"] for line in body.splitlines() if '"total_tokens"' in line]
    assert usage and usage[-1]["completion_tokens"] == 160
    assert "".join(pieces) == "".join(unbroken)
    migrated = rf"worker {dead} went away after \d+ tokens; migrated to {other}"
    assert re.search(migrated, platform.log("server"))

    # and the worker without an engine left the fleet and stopped, saying why, with an error code
    assert platform.workers[dead].wait(timeout=60) != 0
    assert "vLLM's engine core died" in platform.log(f"worker-{dead}")
    assert not platform.redis.exists(platform.heartbeat_key(dead))

    # (started again: the last test needs the pair)
    platform.start_worker(dead, "--engine", "vllm", "--threads", "1", python=str(VLLM_PYTHON))
    platform.wait_for_workers(dead, timeout=500)


def descendants(pid: int) -> list[int]:
    """A process's children, theirs, and so on (from /proc): vLLM's engine core and its worker."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


# Last: it kills one of the pair.
def test_requests_on_a_vllm_worker_killed_before_their_first_token_are_answered_by_the_other(
    vllm_pair, origin
) -> None:
    # given the pair, requests going to vb while va is disabled
    platform = vllm_pair
    url = origin.add("/doomed.png", picture(11), content_type="image/png")
    set_enabled(platform, "va", False)
    assert chat(platform, image_request(url)).headers["X-Routed-Worker"] == "vb"

    # when vb freezes with two requests routed to it (one streamed), and is then killed: no
    # token of theirs came out
    engine_processes = descendants(platform.workers["vb"].pid)
    platform.stop_worker("vb", signal.SIGSTOP, wait=False)
    answers: dict[int, httpx.Response] = {}

    def ask(i: int) -> None:
        answers[i] = chat(platform, image_request(url, stream=i == 1))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    load = LoadTracker(platform.redis, platform.namespace)
    deadline = time.monotonic() + 30
    while load.snapshot(["vb"])["vb"].active_requests < 2:
        assert time.monotonic() < deadline, "the requests never both reached vb"
        time.sleep(0.05)
    set_enabled(platform, "va", True)
    platform.stop_worker("vb", signal.SIGKILL)
    try:
        for thread in threads:
            thread.join(timeout=120)
    finally:
        for pid in engine_processes:  # whatever of vLLM's engine core outlived its killed parent
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # then both were answered 200 by va, the stream too, as if nothing had happened
    assert sorted(answers) == [0, 1]
    for i, response in answers.items():
        assert response.status_code == 200, response.text
        assert response.headers["X-Routed-Worker"] == "va"
        if i == 0:
            assert response.json()["usage"]["completion_tokens"] > 0
        else:
            assert '"error"' not in response.text and response.text.endswith("data: [DONE]\n\n")
    assert "migrated to va" in platform.log("server")
