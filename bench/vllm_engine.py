"""The platform in front of two vLLM workers, against vLLM's AsyncLLM driven directly, in one run.

Usage: `.venv/bin/python bench/vllm_engine.py [--requests N] [--size medium|small|tiny]
[--max-tokens N] [--passes N]` (needs `make vllm`; Redis at REDIS_URL, default
redis://127.0.0.1:6379/14, under a namespace of its own that is deleted afterwards). It builds
the Qwen2-VL demo checkpoint of `--size` into a temporary directory, unless MODEL_PATH names one:
by default medium (about 8x tiny's compute per token), the size whose direct run lands in the
issue's 150-400 tok/s on this 2-core machine, quiet, with the model in the engine core's process
as the workers run it (222-283 tok/s in runs on 2026-12-05; small made 505-529 there, above the
range, and 354-436 with vLLM's multiprocess executor; tiny spends its time in vLLM's per-step
overheads). About 5-7 minutes at 100 requests on a quiet 2-core machine, most of it the
platform's concurrency-1 run and four vLLM engines starting, two at a time.

The workload: REQUESTS chat requests, each a system prompt (one of SYSTEM_PROMPTS, Zipf-like
popularity), one image (one of IMAGES noise pictures, Zipf-like) and a question (one of a few),
greedy, MAX_TOKENS tokens at most. Repeats of a system prompt share its blocks; repeats of a
system prompt with an image share those too; the question and the answer never do.

Three figures, last line `agreement=<x.xxx> platform_over_direct_c8=<x.xx>
platform_cpu_ms_per_1k_tokens=<n>`:
- agreement: at concurrency 1, the share of requests whose router overlap on the chosen worker
  (X-Routing-Overlap: blocks the worker's vLLM KV events put in the index; predicted blocks off,
  ROUTER_PREDICTED_TTL_SECS=0), capped at floor((prompt_tokens - 1) / block) because vLLM never
  caches a prompt's last token, equals floor(num_cached_tokens / block) as vLLM reports it
  (`cached_tokens`). The concurrency-8 run's figure is printed beside it: there the index may lag
  a prompt vLLM is still computing for another request.
- platform_over_direct_c8: output tokens/s through the platform (streamed chat completions at
  concurrency 8, two vLLM workers of one OpenMP thread each, empty caches) over the same prompts
  driven into AsyncLLM directly, in a process of the bench's own holding two AsyncLLM engines
  configured as the workers configure theirs (one OpenMP thread each, 8 users, user k on engine
  k mod 2, empty caches). Each side runs PASSES passes (`--passes`), both prefix caches emptied
  before each, and the figure is the ratio of the two sides' median passes: the direct passes
  first (its engines warmed by a request of their own), then the platform's (after its
  concurrency-1 run), each side alone on the machine. Every pass is printed; the platform's
  prompts must count the same tokens as the direct run's, or the bench stops.
- platform_cpu_ms_per_1k_tokens: the CPU time of the frontend process and of the two worker
  processes (their own, not vLLM's engine core children) during a platform pass, less the
  direct passes' median CPU time of the direct run's process (AsyncLLM's own client side: input
  processing, detokenizing, which the worker process does as well), per 1,000 streamed tokens:
  what the platform's frontend and worker adapter add (the median over the platform's passes).
  Redis's CPU is not counted, nor the bench's own HTTP client's, printed beside each pass: on a
  small machine both take cores the engines would use.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
WORKERS = ("v0", "v1")
BLOCK_SIZE = 32  # vLLM's CPU attention block; the whole deployment hashes in it
KV_CACHE_MB = 256  # per engine: holds the workload's working set, so nothing is evicted
MAX_RUNNING = 16  # vLLM's max_num_seqs, the workers' ENGINE_MAX_RUNNING
MAX_MODEL_LEN = 8192
IMAGE_SIDE = 336  # 144 image tokens on the demo model
IMAGES = 12
SYSTEM_PROMPTS = 3
SYSTEM_WORDS = 120
CONCURRENCY = 8
MAX_TOKENS = 32
REQUESTS = 100
PASSES = 3  # concurrency-8 passes of each side, one side after the other; the figure is their medians'
ZIPF_EXPONENT = 1.0
SEED = 3505

_VOCABULARY = (
    "matte steel frame walnut handle linen cover brass hinge oak veneer ceramic glaze woven strap "
    "leather sole cotton lining glass lid copper base rubber grip velvet seat maple drawer wool"
)
_QUESTIONS = (
    "What colour is the main object in this picture?",
    "Describe the texture of the surface you can see.",
    "How many distinct parts can you count in the image?",
    "Write a one-line advertisement for this item.",
    "Is there any visible damage or wear on it?",
)


# --- the workload ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Ask:
    """One request of the workload, by index into the system prompts, images and questions."""

    system: int
    image: int
    question: int


def system_prompt(n: int) -> str:
    rng, vocabulary = random.Random(f"system-{n}"), _VOCABULARY.split()
    return f"You are assistant {n} of a furniture shop. " + " ".join(
        rng.choice(vocabulary) for _ in range(SYSTEM_WORDS)
    )


def plan(requests: int, seed: int = SEED) -> list[Ask]:
    """Zipf-like popularity over system prompts and images (the hot ones not simply the first)."""
    rng = random.Random(seed)

    def picker(count: int):
        weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(count)]
        ranking = rng.sample(range(count), count)
        return lambda: rng.choices(ranking, weights)[0]

    system, image = picker(SYSTEM_PROMPTS), picker(IMAGES)
    return [Ask(system(), image(), rng.randrange(len(_QUESTIONS))) for _ in range(requests)]


def messages(ask: Ask, image: dict) -> list[dict]:
    """The chat messages of `ask`, its image given as `image` (an image_url part, or vLLM's)."""
    return [
        {"role": "system", "content": system_prompt(ask.system)},
        {"role": "user", "content": [image, {"type": "text", "text": _QUESTIONS[ask.question]}]},
    ]


def image_png(n: int) -> bytes:
    from bench.samples import noise_png

    return noise_png(f"vllm-bench-{n}", IMAGE_SIDE)


def _stat_fields(pid: int | str) -> list[str]:
    """/proc/<pid>/stat's fields after the process name (field 3, the state, first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_s(pid: int | str = "self") -> float:
    """User plus system CPU seconds of one process (not its children), from /proc."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engines_cpu_s(parents: Sequence[int]) -> float:
    """The CPU seconds of every live descendant of `parents` (vLLM's engine core and model
    worker processes under a worker or the direct run), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int(_stat_fields(entry.name)[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    total, stack = 0.0, [child for parent in parents for child in children.get(parent, [])]
    while stack:
        pid = stack.pop()
        stack.extend(children.get(pid, []))
        try:
            total += process_cpu_s(pid)
        except OSError:
            continue
    return total


@dataclass
class RunFigures:
    """What one concurrency-8 run served: tokens, time and the driving process's CPU."""

    wall_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cpu_s: float = 0.0
    # vLLM's own processes under it (engine cores, model workers): where the steps are computed
    engines_cpu_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s


# --- vLLM driven directly (runs in .venv-vllm: `bench/vllm_engine.py --direct SPEC`) -----------------
def engine_args(model: str) -> dict:
    """The engine arguments a vLLM worker gives AsyncLLM (workers.vllm_engine.engine), KV events
    aside: what the direct run must match to be the same engine."""
    return {
        "model": model,
        "tokenizer": model,
        "enforce_eager": True,
        "block_size": BLOCK_SIZE,
        "kv_cache_memory_bytes": KV_CACHE_MB << 20,
        "enable_prefix_caching": True,
        "max_num_seqs": MAX_RUNNING,
        "max_model_len": MAX_MODEL_LEN,
        "dtype": "float32",
        "limit_mm_per_prompt": {"image": 8, "video": 0},
    }


def run_direct(spec: dict) -> None:
    """Two AsyncLLM engines (one OpenMP thread each), CONCURRENCY users, user k on engine k mod 2:
    started once, then one concurrency-8 pass per `pass` line on stdin (both prefix caches
    emptied first), each answered with a `RESULT` line; ends at end of input."""
    # As run_worker --threads 1 sets them on a CPU: unbound, one thread, the model in the engine
    # core's process (workers/management/commands/run_worker.py, _bound_vllm_threads).
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from PIL import Image
    from transformers import AutoTokenizer
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model = spec["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    images = [Image.open(path).convert("RGB") for path in spec["images"]]
    asks = [Ask(**ask) for ask in spec["asks"]]
    prompts = [
        tokenizer.apply_chat_template(
            messages(ask, {"type": "image"}), tokenize=False, add_generation_prompt=True
        )
        for ask in asks
    ]
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0)

    async def one_pass(engines: list, number: int) -> RunFigures:
        for engine in engines:
            await engine.reset_prefix_cache()
        pending = list(enumerate(zip(asks, prompts, strict=True)))
        totals = [0, 0, 0]

        async def user(k: int) -> None:
            engine = engines[k % len(engines)]
            while pending:
                n, (ask, prompt) = pending.pop(0)
                request = {"prompt": prompt, "multi_modal_data": {"image": images[ask.image]}}
                async for output in engine.generate(request, params, f"direct-{number}-{n}"):
                    if output.finished:
                        totals[0] += len(output.prompt_token_ids)
                        totals[1] += len(output.outputs[0].token_ids)
                        totals[2] += output.num_cached_tokens or 0

        cpu, started = process_cpu_s(), time.perf_counter()
        await asyncio.gather(*(user(k) for k in range(CONCURRENCY)))
        wall, cpu = time.perf_counter() - started, process_cpu_s() - cpu
        return RunFigures(wall, *totals, cpu_s=cpu)

    async def drive() -> None:
        engines = [AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(model))) for _ in WORKERS]
        try:
            for n, engine in enumerate(engines):  # the first forward pass is no request's
                async for _ in engine.generate("warm up", SamplingParams(max_tokens=2), f"warm-{n}"):
                    pass
            print("READY", flush=True)
            number = 0
            while (await asyncio.to_thread(sys.stdin.readline)).strip() == "pass":
                figures = await one_pass(engines, number)
                print("RESULT " + json.dumps(asdict(figures)), flush=True)
                number += 1
        finally:
            for engine in engines:
                engine.shutdown()

    asyncio.run(drive())


class DirectEngines:
    """The direct run's process (`--direct SPEC`, in .venv-vllm), its engines started and warmed
    once and kept for every pass (each pass empties their prefix caches first)."""

    def __init__(self, model: Path, image_paths: list[Path], asks: list[Ask], max_tokens: int, scratch: Path):
        spec = scratch / "direct.json"
        spec.write_text(
            json.dumps(
                {
                    "model": str(model),
                    "images": [str(path) for path in image_paths],
                    "asks": [asdict(ask) for ask in asks],
                    "max_tokens": max_tokens,
                }
            )
        )
        self._log = (scratch / "direct.log").open("w+")
        self._process = subprocess.Popen(
            [str(VLLM_PYTHON), __file__, "--direct", str(spec)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
        self._expect("READY")

    def run_pass(self) -> RunFigures:
        """One concurrency-8 pass over every ask, both engines' prefix caches emptied first."""
        assert self._process.stdin is not None
        engines_before = engines_cpu_s([self._process.pid])
        self._process.stdin.write("pass\n")
        self._process.stdin.flush()
        figures = RunFigures(**json.loads(self._expect("RESULT ")[len("RESULT ") :]))
        figures.engines_cpu_s = engines_cpu_s([self._process.pid]) - engines_before
        return figures

    def _expect(self, prefix: str) -> str:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            if line.startswith(prefix):
                return line.rstrip("\n")
        self._log.seek(0)
        raise RuntimeError(f"the direct run failed:\n{self._log.read()[-3000:]}")

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
        self._log.close()


# --- the platform -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Answer:
    """One streamed answer as the client saw it."""

    worker: str
    overlap_blocks: int
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int

    def agrees(self) -> bool:
        """The router's overlap, capped at what vLLM can cache of this prompt, is vLLM's hit."""
        cacheable = (self.prompt_tokens - 1) // BLOCK_SIZE
        return min(self.overlap_blocks, cacheable) == self.cached_tokens // BLOCK_SIZE


def ask_platform(client, base_url: str, ask: Ask, url: str, max_tokens: int) -> Answer:
    body = {
        "model": "demo",
        "messages": messages(ask, {"type": "image_url", "image_url": {"url": url}}),
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    usage: dict = {}
    with client.stream("POST", f"{base_url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(
                f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:300]}"
            )
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[len("data: ") :])
                if "error" in chunk:
                    raise RuntimeError(f"stream error: {chunk['error']}")
                usage = chunk.get("usage") or usage
        overlap = int(response.headers.get("X-Routing-Overlap", "0/0").split("/")[0])
        worker = response.headers["X-Routed-Worker"]
    return Answer(
        worker,
        overlap,
        int(usage["prompt_tokens"]),
        int(usage["completion_tokens"]),
        int(usage["prompt_tokens_details"]["cached_tokens"]),
    )


def drive_platform(
    base_url: str, headers: dict, asks: Sequence[Ask], urls: Sequence[str], concurrency: int, max_tokens: int
) -> tuple[list[Answer], float]:
    """`concurrency` users in a closed loop over `asks`: the answers, in the asks' order, and the
    wall time."""
    import httpx

    answers: list[Answer | None] = [None] * len(asks)
    pending = list(range(len(asks)))
    lock = threading.Lock()
    failures: list[str] = []

    def user() -> None:
        with httpx.Client(timeout=300, headers=headers) as client:
            while True:
                with lock:
                    if not pending:
                        return
                    n = pending.pop(0)
                try:
                    answers[n] = ask_platform(client, base_url, asks[n], urls[asks[n].image], max_tokens)
                except (httpx.HTTPError, RuntimeError, KeyError) as exc:
                    failures.append(f"request {n}: {exc}")

    started = time.perf_counter()
    users = [threading.Thread(target=user, name=f"user-{k}") for k in range(concurrency)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    wall = time.perf_counter() - started
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, first: {failures[0]}")
    return [answer for answer in answers if answer is not None], wall


def flush_kv(platform) -> None:
    """Empty both workers' vLLM prefix caches (their `cleared` events empty the index too)."""
    platform.manage("flush_caches", "--cache", "kv", "--json")
    time.sleep(1.0)  # the workers' cleared events reach the index


def agreement(answers: Sequence[Answer]) -> float:
    return sum(answer.agrees() for answer in answers) / len(answers)


def model_dir(scratch: Path, size: str) -> Path:
    configured = os.environ.get("MODEL_PATH")
    if configured:
        return Path(configured).resolve()
    from workers.demo_model import build_demo_model

    path = scratch / f"demo-{size}"
    print(f"building the {size} demo model into {path}", flush=True)
    build_demo_model(path, size=size)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=REQUESTS)
    parser.add_argument(
        "--size", default="medium", help="the demo checkpoint's size (build_demo_model --size)"
    )
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    parser.add_argument("--passes", type=int, default=PASSES, help="concurrency-8 passes of each side")
    parser.add_argument("--direct", type=Path, help=argparse.SUPPRESS)  # the direct run's own process
    args = parser.parse_args(argv)
    if args.direct is not None:
        run_direct(json.loads(args.direct.read_text()))
        return 0
    if not VLLM_PYTHON.exists():
        print("no .venv-vllm: run `make vllm` first", file=sys.stderr)
        return 2

    from tests.image_server import ImageServer
    from tests.platform_harness import PlatformProcesses

    asks = plan(args.requests)
    redis_url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/14")
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as tmp, ImageServer() as origin:
        scratch = Path(tmp)
        model = model_dir(scratch, args.size)
        pictures = [image_png(n) for n in range(IMAGES)]
        image_paths = []
        for n, png in enumerate(pictures):
            image_paths.append(scratch / f"image-{n}.png")
            image_paths[-1].write_bytes(png)
        urls = [
            origin.add(f"/image-{n}.png", png, content_type="image/png") for n, png in enumerate(pictures)
        ]
        print(
            f"{len(asks)} requests: {SYSTEM_PROMPTS} system prompts, {IMAGES} images of {IMAGE_SIDE} px, "
            f"max_tokens {args.max_tokens}, {len(WORKERS)} engines of one thread each",
            flush=True,
        )

        # The direct passes, then the platform's: the other side's processes are gone by then, as
        # vLLM's idle engines still take some CPU (their workers spin a second after each step).
        started = time.perf_counter()
        direct = DirectEngines(model, image_paths, asks, args.max_tokens, scratch)
        try:
            print(f"direct AsyncLLM engines up in {time.perf_counter() - started:.0f} s", flush=True)
            directs = [direct.run_pass() for _ in range(args.passes)]
        finally:
            direct.close()
        for number, run in enumerate(directs):
            print(direct_line(number, run), flush=True)
        platform = PlatformProcesses(
            scratch,
            model,
            redis_url,
            f"bench:vllm:{uuid.uuid4().hex[:10]}:",
            {
                "MODEL_NAME": "demo",
                "KV_BLOCK_SIZE": str(BLOCK_SIZE),
                "VLLM_KV_CACHE_MB": str(KV_CACHE_MB),
                "ENGINE_MAX_RUNNING": str(MAX_RUNNING),
                "ROUTER_PREDICTED_TTL_SECS": "0",
                "MEDIA_ALLOWED_HOSTS": "127.0.0.1",
                "LOG_LEVEL": "WARNING",
            },
        )
        throughs: list[RunFigures] = []
        try:
            started = time.perf_counter()
            for name in WORKERS:
                platform.start_worker(name, "--engine", "vllm", "--threads", "1", python=str(VLLM_PYTHON))
                time.sleep(1.5)  # registrations at one instant can lock SQLite
            platform.wait_for_workers(*WORKERS, timeout=900)
            base_url = platform.start_server()
            print(f"platform up in {time.perf_counter() - started:.0f} s", flush=True)

            flush_kv(platform)
            one, one_wall = drive_platform(base_url, platform.headers, asks, urls, 1, args.max_tokens)
            print(
                f"platform c1: {sum(a.completion_tokens for a in one)} tokens in {one_wall:.1f} s, "
                f"agreement {agreement(one):.3f} ({sum(a.agrees() for a in one)}/{len(one)})",
                flush=True,
            )
            for n, answer in enumerate(one):
                if not answer.agrees():
                    print(f"  disagrees: request {n} {asks[n]} {answer}", flush=True)

            pids = [process.pid for process in (*platform.workers.values(), platform.servers[0])]
            for number in range(args.passes):
                flush_kv(platform)
                cpu_before = [process_cpu_s(pid) for pid in pids]
                client_before = process_cpu_s()
                engines_before = engines_cpu_s(pids[:-1])
                eight, eight_wall = drive_platform(
                    base_url, platform.headers, asks, urls, CONCURRENCY, args.max_tokens
                )
                cpu = [process_cpu_s(pid) - before for pid, before in zip(pids, cpu_before, strict=True)]
                throughs.append(
                    RunFigures(
                        eight_wall,
                        sum(a.prompt_tokens for a in eight),
                        sum(a.completion_tokens for a in eight),
                        sum(a.cached_tokens for a in eight),
                        sum(cpu),
                        engines_cpu_s(pids[:-1]) - engines_before,
                    )
                )
                if throughs[-1].prompt_tokens != directs[0].prompt_tokens:
                    print(
                        f"the platform's prompts counted {throughs[-1].prompt_tokens} tokens, the direct "
                        f"run's {directs[0].prompt_tokens}: not the same prompts",
                        file=sys.stderr,
                    )
                    return 1
                client_cpu = process_cpu_s() - client_before
                print(platform_line(number, throughs[-1], agreement(eight), cpu, client_cpu), flush=True)
        finally:
            platform.close()

    # Each side's median pass: a slow spell of the machine moves one pass, not the figure.
    direct_rate = statistics.median(figures.tokens_per_s for figures in directs)
    through_rate = statistics.median(figures.tokens_per_s for figures in throughs)
    direct_cpu = statistics.median(figures.cpu_s for figures in directs)
    own_cpu_ms = statistics.median(
        (through.cpu_s - direct_cpu) * 1e6 / through.completion_tokens for through in throughs
    )
    print(
        f"median of {len(directs)} passes each: direct {direct_rate:.0f} tok/s, "
        f"platform {through_rate:.0f} tok/s",
        flush=True,
    )
    print(
        f"agreement={agreement(one):.3f} "
        f"platform_over_direct_c8={through_rate / direct_rate:.2f} "
        f"platform_cpu_ms_per_1k_tokens={own_cpu_ms:.0f}"
    )
    return 0


def direct_line(number: int, run: RunFigures) -> str:
    return (
        f"direct pass {number + 1}: AsyncLLM c{CONCURRENCY} {run.completion_tokens} tokens in "
        f"{run.wall_s:.1f} s = {run.tokens_per_s:.0f} tok/s, {run.cached_tokens}/{run.prompt_tokens} "
        f"prompt tokens cached, client CPU {run.cpu_s:.2f} s, vLLM's engine processes "
        f"{run.engines_cpu_s:.1f} s"
    )


def platform_line(number: int, run: RunFigures, agreed: float, cpu: list[float], client_cpu: float) -> str:
    workers = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in zip(WORKERS, cpu, strict=False))
    return (
        f"platform pass {number + 1}: c{CONCURRENCY} {run.completion_tokens} tokens in {run.wall_s:.1f} s = "
        f"{run.tokens_per_s:.0f} tok/s, {run.cached_tokens}/{run.prompt_tokens} prompt tokens cached, "
        f"agreement {agreed:.3f}; CPU: frontend {cpu[-1]:.2f} s, workers {workers}; this bench's "
        f"HTTP client {client_cpu:.2f} s; vLLM's engine processes {run.engines_cpu_s:.1f} s"
    )


if __name__ == "__main__":
    raise SystemExit(main())
