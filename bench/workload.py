"""The real platform under four multimodal chat workloads: KV-aware routing against round robin
and random, over three seeds, with medians and their spread.

Usage: `.venv/bin/python bench/workload.py [--requests N] [--seeds N] [--shapes a,b,c,d]
[--products N] [--kv-blocks N] [--origin-latency-ms MS] [--load F] [--think-ms MS] [--noise-floor]`
(Redis at REDIS_URL, default redis://127.0.0.1:6379/14, under a namespace of its own that is
deleted afterwards; the model at MODEL_PATH, default var/models/demo, built into a temporary
directory if absent). Bounded: 4 shapes x 3 modes x 3 seeds x REQUESTS requests (36 runs of 30),
about 4.5 minutes on a quiet 2-core machine and under 8 on a busy one. It prints a table per
shape and, as its last line:
    shapes=4 worst_hit_kv_over_rr=<x.xx> worst_ttft_p50_kv_over_rr=<x.xx>
    best_ttft_p50_kv_over_rr=<x.xx> overlap_given_up=<x.xxx>   (on one line)
where each ratio is of medians over the seeds, worst/best over the shapes, and overlap_given_up
is the KV router's given-up share of the best eligible overlap (blocks), over every kv run.

The shapes (why each: routing that is right for one can be wrong for another):
(a) sessions about one image: a user opens one product and asks 1-4 questions in a row, each
    after the previous answer (x-session-id per user). Hard session affinity helps here.
(b) sessions unrelated to images: a user asks about a different Zipf-chosen product each turn
    under one session id. Affinity that overrides the cost sends a session's turns to where
    its *previous* image is, away from where this one is cached.
(c) multi-turn conversations: a user opens a conversation with two photos of their own (never
    seen before) and asks 2-5 questions in a row; each turn appends to the previous prompt with the
    assistant's answer (ANSWER_WORDS, a stand-in of a real answer's length), so the prefix that
    matters is the conversation's history, held by whichever worker served its last turn.
(d) a long shared system prompt with unique images: every request's prefix up to the image is
    the same everywhere, its image never seen before: the router must balance load, not chase
    a prefix every worker holds.

Common to all: PRODUCTS distinct noise PNGs of IMAGE_SIDE px (256 image tokens on the demo
model), Zipf-like popularity, catalogue text per product, CONCURRENCY users in a closed loop,
max_tokens MAX_TOKENS (the figures are about prefill), two workers of one torch thread each
whose KV cache (KV_CAPACITY_BLOCKS) cannot hold the working set. The workers are started once;
before every run their caches (KV, embeddings, decoded images) are flushed and the router's
load, index and affinity are empty, which is what fresh workers would have, without paying a
model load 36 times. The same seed gives the same requests in every mode.

The default catalogue is the traffic of the report that opened issue 10: PRODUCTS pictures,
KV_CAPACITY_BLOCKS-block caches, about five products' prefixes per worker. `--products` and
`--kv-blocks` change it. A catalogue whose hot products both workers hold under round robin too
(`--products 12 --kv-blocks 200`, this bench's default before) tells less: round robin's median
request in shape (a) is then a warm one in some seeds and a cold one in others, and a TTFT p50
compares a warm request with a warm request whichever router is used. Even at the default,
round robin serves about 17 of 30 requests warm in one seed's shape (a) and 13-16 in another,
so its median request there is warm, or on the divide. Each shape also prints how
many requests each mode served warm (half the prompt cached or more) beside the most any router
could: every request but the first to show its prefix (its product, conversation or system
prompt). A router at that bound leaves nothing to win on hits; its TTFT p50 can then beat round
robin's only by as much as round robin's median request is colder than its own; the pooled p50
and mean printed beside each kv/rr ratio move less from seed to seed.

Shape (d) is the control: every request costs the same wherever it goes, so in a closed loop on a
saturated machine each mode's throughput, and with it its mean TTFT (Little's law), is the same;
the ratio there measures harm, around 1.00. Its p50 is also this bench's noisiest figure, for a
reason no router changes: the users ask in bursts. A worker's two requests end within a step of
each other (continuous batching computes the first one's last tokens in the steps of the second
one's prompt), so both users ask again at once, and the two workers keep one period. Of four
requests arriving together on two workers that each compute one prompt at a time, two wait for
another's prompt whoever routes them: TTFT falls into two groups about a prompt's wait apart (about
185 and 270 ms here), about half the requests in each, and a run's p50 lands on either side of the
gap by chance. The line "arrived in a burst of all users" below counts them: 40-80% of (d)'s
requests in the runs of 30 and 60 measured, in every mode. Between runs each seed's p50 moves by
10-15% either way (9-14% coefficient of variation at 30, 60 and 90 requests alike: it is the run,
not the sample) and the median of three seeds by up to about 10%, so one run tells a tie from a
loss only beyond that. A think time between turns (`--think-ms 100`: exponential, 100 ms) breaks
most bursts (13-27% of requests came in one) and merges the groups, and the tie stays a tie (kv 182
ms, round robin 181 ms, medians over the three seeds). `--noise-floor` measures the noise in the
same run: round robin goes a second time per seed and shape, and its TTFT p50 over round robin's is
printed beside kv's (not in the last line).

`--load F` runs an open loop instead: sessions start at Poisson times (the same times in every
mode for one seed), each asking its turns one after another, at F times the requests a second
that round robin served in a closed loop of the same shape (one calibration run per shape, not
reported). It shows what a closed loop hides: with no fixed number of users, a router that keeps
requests on the worker holding their prefix can let a queue grow there while another worker
idles. On this 2-core machine its p50s move by up to 2x between repeats of one seed, so it
informs rather than decides.

`--origin-latency-ms` delays every answer of the image origin (a remote one is tens of ms away):
a request pays it wherever the platform asks the origin, the frontend's size read (which
MEDIA_SIZE_CACHE_SECS keeps for repeats) and a worker's fetch of a picture it does not hold."""

from __future__ import annotations

import argparse
import os
import queue
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import redis  # noqa: E402

from bench.samples import noise_png, quantile, stream_chat  # noqa: E402
from tests.image_server import ImageServer  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

MODES = ("kv", "round_robin", "random")
# --noise-floor: round robin once more per seed and shape, on the same frontend; its TTFT p50
# over round robin's is what the kv/rr ratio moves by when nothing differs but the run.
AGAIN = "rr_again"
SHAPES = ("a", "b", "c", "d")
WORKERS = ("w0", "w1")
SEEDS = (20260, 20261, 20262)
BLOCK_SIZE = 16
IMAGE_SIDE = 448  # the demo model's max_pixels: 256 image tokens
PRODUCTS = 60  # issue 10's report: 60 pictures of Zipf-like popularity
DESCRIPTION_WORDS = 150
SYSTEM_WORDS = 300  # shape (d)'s shared system prompt
PHOTOS_PER_CONVERSATION = 2  # shape (c): the photos a conversation opens with
ANSWER_WORDS = 40  # shape (c)'s assistant answers in the history (max_tokens keeps real ones short)
ZIPF_EXPONENT = 1.0
CONCURRENCY = 4
MAX_TOKENS = 4
REQUESTS = 30  # per run; 36 runs
KV_CAPACITY_BLOCKS = 250  # per worker, as in that report: ~5 of the products' prefixes
BURST_GAP_S = 0.06  # requests sent closer than this in a row count as one burst (under a prompt's wait)

_VOCABULARY = (
    "matte steel frame walnut handle linen cover brass hinge oak veneer ceramic glaze woven strap "
    "leather sole cotton lining glass lid copper base rubber grip velvet seat maple drawer wool "
    "blend zinc buckle bamboo tray marble top nylon mesh canvas panel chrome knob cedar shelf"
)
_QUESTIONS = (
    "What colour is the main object in this picture?",
    "Is this product suitable for outdoor use?",
    "Describe the texture of the surface you can see.",
    "How many distinct parts can you count in the image?",
    "Would this fit in a small apartment kitchen?",
    "Write a one-line advertisement for this item.",
    "What material does the frame appear to be made of?",
    "Is there any visible damage or wear on it?",
)


@dataclass(frozen=True)
class Turn:
    """One request: whose session, and the chat messages it sends."""

    session: int
    messages: tuple  # JSON-ready messages (tuples of dicts, frozen for hashing by identity)
    key: str  # what makes two turns the same prompt
    # What must have been seen before for this turn to be warm (at least half its prompt cached):
    # its product in (a) and (b), its conversation in (c), the system prompt in (d).
    prefix: str = ""


@dataclass
class Outcome:
    turn: Turn
    sent_at: float
    worker: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float


@dataclass
class RunResult:
    shape: str
    mode: str
    seed: int
    outcomes: list[Outcome]
    wall_s: float
    best_overlap: int = 0
    given_up: int = 0
    failures: list[str] = field(default_factory=list)
    reasons: list[tuple[int, int, str]] = field(default_factory=list)  # overlap, best, reason

    @property
    def hit_rate(self) -> float:
        return sum(o.cached_tokens for o in self.outcomes) / max(
            sum(o.prompt_tokens for o in self.outcomes), 1
        )

    @property
    def ttft_p50(self) -> float:
        return quantile([o.ttft_s for o in self.outcomes], 0.5)

    def split_ttft_p50(self) -> tuple[int, float, float]:
        """Requests with at least half their prompt cached, and the TTFT p50 of those and of the
        rest (NaN for an empty group): which side of the divide a run's p50 falls on."""
        warm = [o.ttft_s for o in self.outcomes if o.cached_tokens * 2 >= o.prompt_tokens]
        cold = [o.ttft_s for o in self.outcomes if o.cached_tokens * 2 < o.prompt_tokens]
        nan = float("nan")
        return len(warm), quantile(warm, 0.5) if warm else nan, quantile(cold, 0.5) if cold else nan

    def split_by_queue(self) -> tuple[int, float, float]:
        """Requests that reached a worker while another request there had not had its first token
        yet (a prompt still prefilling, which a new one waits behind on a single-threaded engine),
        and the TTFT p50 of those and of the rest: on a saturated machine, what sets a run's p50
        once the caches no longer differ (shape (d))."""
        behind, rest = [], []
        for o in self.outcomes:
            queued = any(
                q is not o and q.worker == o.worker and q.sent_at < o.sent_at < q.sent_at + q.ttft_s
                for q in self.outcomes
            )
            (behind if queued else rest).append(o.ttft_s)
        nan = float("nan")
        return len(behind), quantile(behind, 0.5) if behind else nan, quantile(rest, 0.5) if rest else nan

    def burst_share(self, users: int, gap_s: float = BURST_GAP_S) -> float:
        """The share of requests sent in a burst of `users` requests, each within `gap_s` of the one
        before: in a closed loop of that many users, every user asking at once (shape (d))."""
        times = sorted(o.sent_at for o in self.outcomes)
        bursts: list[int] = []
        for k, at in enumerate(times):
            if k and at - times[k - 1] <= gap_s:
                bursts[-1] += 1
            else:
                bursts.append(1)
        return sum(size for size in bursts if size >= users) / max(len(times), 1)

    @property
    def imbalance(self) -> float:
        counts = Counter(o.worker for o in self.outcomes)
        per_worker = [counts.get(name, 0) for name in WORKERS]
        return max(per_worker) / max(sum(per_worker) / len(per_worker), 1e-9)


# --- the workloads ---------------------------------------------------------------------------------
def words(seed: str, n: int) -> str:
    rng = random.Random(seed)
    vocabulary = _VOCABULARY.split()
    return " ".join(rng.choice(vocabulary) for _ in range(n))


def description(product: int) -> str:
    return f"Catalogue entry {product}: {words(f'description-{product}', DESCRIPTION_WORDS)}."


def user_turn(image_urls: str | Sequence[str] | None, text: str) -> dict:
    if isinstance(image_urls, str):
        image_urls = [image_urls]
    content: list[dict] = [{"type": "image_url", "image_url": {"url": url}} for url in image_urls or ()]
    content.append({"type": "text", "text": text})
    return {"role": "user", "content": content}


class Catalogue:
    """The products' images on a local origin, plus one-off images for shape (d)."""

    def __init__(self, origin: ImageServer, salt: str, products: int = PRODUCTS) -> None:
        self._origin = origin
        self._salt = salt
        self.products = [
            origin.add(f"/{salt}/product-{n}.png", noise_png(f"{salt}-{n}", IMAGE_SIDE))
            for n in range(products)
        ]
        self._unique = 0

    def unique(self) -> str:
        self._unique += 1
        return self._origin.add(
            f"/{self._salt}/unique-{self._unique}.png",
            noise_png(f"{self._salt}-unique-{self._unique}", IMAGE_SIDE),
        )


def zipf_picker(rng: random.Random, products: int) -> Callable[[], int]:
    weights = [1 / (rank + 1) ** ZIPF_EXPONENT for rank in range(products)]
    ranking = rng.sample(range(products), products)  # the hot products are not simply the first
    return lambda: rng.choices(ranking, weights)[0]


def plan(shape: str, requests: int, seed: int, catalogue: Catalogue) -> list[list[Turn]]:
    """Sessions of turns for one shape; the same seed and catalogue give the same sessions."""
    rng = random.Random(f"{shape}-{seed}")
    pick = zipf_picker(rng, len(catalogue.products))
    sessions: list[list[Turn]] = []
    planned = 0
    system = {
        "role": "system",
        "content": "You are a catalogue assistant. " + words(f"system-{seed}", SYSTEM_WORDS),
    }
    while planned < requests:
        n = len(sessions)
        length = min(rng.choice((2, 3, 4, 5) if shape == "c" else (1, 2, 3, 4)), requests - planned)
        turns: list[Turn] = []
        if shape == "a":
            product = pick()
            for question in rng.sample(range(len(_QUESTIONS)), length):
                text = f"{description(product)}\n\nQuestion: {_QUESTIONS[question]}"
                turns.append(
                    Turn(
                        n,
                        (user_turn(catalogue.products[product], text),),
                        f"a{product}-{question}",
                        f"p{product}",
                    )
                )
        elif shape == "b":
            for _ in range(length):
                product, question = pick(), rng.randrange(len(_QUESTIONS))
                text = f"{description(product)}\n\nQuestion: {_QUESTIONS[question]}"
                turns.append(
                    Turn(
                        n,
                        (user_turn(catalogue.products[product], text),),
                        f"b{product}-{question}",
                        f"p{product}",
                    )
                )
        elif shape == "c":
            photos = [catalogue.unique() for _ in range(PHOTOS_PER_CONVERSATION)]
            history: list[dict] = []
            for k, question in enumerate(rng.sample(range(len(_QUESTIONS)), length)):
                history = [*history, user_turn(photos if k == 0 else [], _QUESTIONS[question])]
                turns.append(Turn(n, tuple(history), f"c{n}-{k}", f"c{n}"))
                # The answer becomes part of the next turn's prompt (a fixed one: the model's text
                # would make the prompts differ between modes).
                answer = f"About your photo: {words(f'answer-{seed}-{n}-{k}', ANSWER_WORDS)}."
                history = [*history, {"role": "assistant", "content": answer}]
        elif shape == "d":
            for _ in range(length):
                question = rng.randrange(len(_QUESTIONS))
                turns.append(
                    Turn(
                        n,
                        (system, user_turn(catalogue.unique(), _QUESTIONS[question])),
                        f"d{n}-{len(turns)}",
                        "system",
                    )
                )
        else:
            raise ValueError(f"unknown shape {shape!r}")
        sessions.append(turns)
        planned += len(turns)
    return sessions


# --- driving the platform --------------------------------------------------------------------------
def send(client: httpx.Client, base_url: str, turn: Turn, session_salt: str) -> Outcome:
    """One streamed request; TTFT is the time to the first chunk carrying generated text."""
    body = {
        "model": "demo",
        "messages": list(turn.messages),
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": f"bench-{session_salt}-{turn.session}"}
    answer = stream_chat(client, base_url, body, headers)
    if not answer.usage or answer.worker is None:
        raise RuntimeError("the answer did not say its usage or its worker")
    return Outcome(
        turn=turn,
        sent_at=answer.sent_at,
        worker=answer.worker,
        prompt_tokens=int(answer.usage["prompt_tokens"]),
        cached_tokens=int(answer.usage["prompt_tokens_details"]["cached_tokens"]),
        ttft_s=answer.ttft_s,
    )


def run_sessions(
    base_url: str,
    sessions: list[list[Turn]],
    session_salt: str,
    headers: dict[str, str],
    session_rate: float | None = None,
    arrivals_seed: int = 0,
    think_s: float = 0.0,
) -> tuple[list[Outcome], float, list[str]]:
    """Closed loop (session_rate None): CONCURRENCY users, each taking the next session and asking
    its turns one after another. Open loop: sessions start at Poisson times, `session_rate` a
    second (the same times in every mode for one seed), each asking its turns one after another,
    however many are open at once. `think_s` > 0: a user waits an exponential time of that mean
    before each turn (the same waits in every mode for one seed)."""
    pending: queue.Queue[list[Turn]] = queue.Queue()
    for session in sessions:
        pending.put(session)
    outcomes: list[Outcome] = []
    failures: list[str] = []
    lock = threading.Lock()

    def ask(client: httpx.Client, session: list[Turn]) -> None:
        for turn in session:
            if think_s > 0:
                time.sleep(random.Random(f"think-{arrivals_seed}-{turn.key}").expovariate(1 / think_s))
            try:
                outcome = send(client, base_url, turn, session_salt)
            except (httpx.HTTPError, RuntimeError, KeyError) as exc:
                with lock:
                    failures.append(f"{turn.key}: {exc}")
                continue
            with lock:
                outcomes.append(outcome)

    def user() -> None:
        with httpx.Client(timeout=180, headers=headers) as client:
            while True:
                try:
                    session = pending.get_nowait()
                except queue.Empty:
                    return
                ask(client, session)

    started = time.perf_counter()
    if session_rate is not None:
        rng = random.Random(f"arrivals-{arrivals_seed}")
        at, starts = 0.0, []
        for _ in sessions:
            starts.append(at)
            at += rng.expovariate(session_rate)

        def arriving(session: list[Turn], start: float) -> None:
            time.sleep(max(0.0, started + start - time.perf_counter()))
            with httpx.Client(timeout=180, headers=headers) as client:
                ask(client, session)

        users = [
            threading.Thread(target=arriving, args=(session, start), name=f"session-{n}")
            for n, (session, start) in enumerate(zip(sessions, starts, strict=True))
        ]
    else:
        users = [threading.Thread(target=user, name=f"user-{n}") for n in range(CONCURRENCY)]
    for thread in users:
        thread.start()
    for thread in users:
        thread.join()
    outcomes.sort(key=lambda o: o.sent_at)
    return outcomes, time.perf_counter() - started, failures


class Bench:
    """One platform (two workers, one frontend per mode) reused across runs, reset before each."""

    def __init__(self, tmp: Path, model: Path, redis_url: str, kv_blocks: int = KV_CAPACITY_BLOCKS) -> None:
        self.namespace = f"bench:workload:{uuid.uuid4().hex[:10]}:"
        self.redis = redis.Redis.from_url(redis_url)
        self.platform = PlatformProcesses(
            tmp,
            model,
            redis_url,
            self.namespace,
            {
                "KV_CAPACITY_BLOCKS": str(kv_blocks),
                "KV_BLOCK_SIZE": str(BLOCK_SIZE),
                "MEDIA_ALLOWED_HOSTS": "127.0.0.1",
                "WORKER_TORCH_THREADS": "1",
                "LOG_LEVEL": "WARNING",
                # Each decision's overlap, best overlap and reason, to explain what kv gave up.
                "LOG_LEVELS": "inference_platform.serving=info",
            },
        )
        self.frontends: dict[str, str] = {}

    def start(self) -> None:
        started = time.perf_counter()
        for name in WORKERS:
            self.platform.start_worker(name)
            time.sleep(1.5)  # registrations at one instant can lock SQLite
        self.platform.wait_for_workers(*WORKERS)
        for mode in MODES:
            self.platform.env["ROUTER_MODE"] = mode
            self.frontends[mode] = self.platform.start_server()
        print(f"platform up in {time.perf_counter() - started:.1f} s", flush=True)

    def reset(self) -> None:
        """Empty caches on both workers, and no load, predicted blocks or affinity left over."""
        subprocess.run(
            [sys.executable, "manage.py", "flush_caches", "--cache", "kv", "--cache", "embeddings",
             "--cache", "images", "--json"],
            cwd=REPO, env=self.platform.env, check=True, capture_output=True, timeout=120,
        )  # fmt: skip
        for pattern in ("aff:*", "kv:approx*", "load:*"):
            for key in self.redis.scan_iter(match=f"{self.namespace}{pattern}", count=1000):
                self.redis.delete(key)

    def routing_counters(self) -> tuple[int, int]:
        """Best overlap and overlap given up (blocks) summed over every decision so far."""
        totals = self.redis.hgetall(f"{self.platform.statistics_namespace}m:total")  # this deployment's
        best = given_up = 0.0
        for raw_field, value in totals.items():
            name = raw_field.decode(errors="replace").split("\x1f", 1)[0]
            if name == "routing_best_overlap_blocks":
                best += float(value)
            elif name == "routing_overlap_given_up_blocks":
                given_up += float(value)
        return int(best), int(given_up)

    def decisions(self, mode: str) -> list[tuple[int, int, str]]:
        """(overlap, best overlap, reason) of every decision the mode's frontend logged so far."""
        mode = _frontend_mode(mode)
        label = "server" if mode == MODES[0] else f"server-{MODES.index(mode)}"
        return [(int(o), int(b), r) for o, b, r in _SENT_LINE.findall(self.platform.log(label))]

    def run(
        self,
        shape: str,
        mode: str,
        seed: int,
        sessions: list[list[Turn]],
        session_rate: float | None = None,
        think_s: float = 0.0,
    ) -> RunResult:
        self.reset()
        logged = len(self.decisions(mode))
        before = self.routing_counters()
        time.sleep(1.2)  # metrics flush each second: counters read below are this run's
        outcomes, wall_s, failures = run_sessions(
            self.frontends[_frontend_mode(mode)],
            sessions,
            f"{shape}{mode}{seed}",
            self.platform.headers,
            session_rate,
            seed,
            think_s,
        )
        time.sleep(1.2)
        after = self.routing_counters()
        result = RunResult(
            shape, mode, seed, outcomes, wall_s, after[0] - before[0], after[1] - before[1], failures
        )
        result.reasons = self.decisions(mode)[logged:]
        return result

    def close(self) -> None:
        self.platform.close()
        self.redis.close()


def _frontend_mode(mode: str) -> str:
    return "round_robin" if mode == AGAIN else mode


_SENT_LINE = re.compile(
    r"\(\d+ prompt tokens, (\d+)/\d+ blocks cached, best (\d+), ([\w-]+)\)$", re.MULTILINE
)


def model_dir(scratch: Path) -> Path:
    configured = os.environ.get("MODEL_PATH")
    path = Path(configured) if configured else REPO / "var" / "models" / "demo"
    path = path if path.is_absolute() else REPO / path
    if (path / "config.json").exists():
        return path
    from workers.demo_model import build_demo_model

    path = scratch / "demo"
    print(f"building the demo model into {path}", flush=True)
    build_demo_model(path)
    return path


def _median_ms(seconds: Sequence[float]) -> str:
    """Median in ms of the runs that had such requests (a run without any has NaN)."""
    present = [s for s in seconds if s == s]
    return f"{statistics.median(present) * 1000:.0f}" if present else "-"


def _pooled(runs: Sequence[RunResult], estimate: Callable[[list[float]], float]) -> float:
    """An estimate of TTFT over every request of the runs: a p50 of all, say, rather than the median
    of each seed's p50, which jumps between the warm and the cold mode when a run's middle request
    sits at the divide (round robin in shape (a))."""
    return estimate([o.ttft_s for run in runs for o in run.outcomes])


def spread(values: Sequence[float]) -> str:
    return f"{statistics.median(values):.3f} [{min(values):.3f}-{max(values):.3f}]"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--requests", type=int, default=REQUESTS, help=f"requests per run (default {REQUESTS})"
    )
    parser.add_argument("--seeds", type=int, default=len(SEEDS), help=f"seeds (default {len(SEEDS)})")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated modes (tuning only)")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated shapes (default a,b,c,d)")
    parser.add_argument(
        "--products", type=int, default=PRODUCTS, help=f"products in the catalogue (default {PRODUCTS})"
    )
    parser.add_argument(
        "--kv-blocks",
        type=int,
        default=KV_CAPACITY_BLOCKS,
        help=f"each worker's KV cache, blocks of {BLOCK_SIZE} tokens (default {KV_CAPACITY_BLOCKS})",
    )
    parser.add_argument(
        "--origin-latency-ms",
        type=float,
        default=0.0,
        help="delay before the image origin answers, standing in for a remote one (default 0)",
    )
    parser.add_argument(
        "--noise-floor",
        action="store_true",
        help="run round robin a second time per seed and shape (after the others) and print its TTFT"
        " p50 and hit rate over round robin's: how far a ratio moves when only the run differs",
    )
    parser.add_argument(
        "--think-ms",
        type=float,
        default=0.0,
        help="each user waits an exponential time of this mean before each turn (default 0)",
    )
    parser.add_argument(
        "--load",
        type=float,
        default=None,
        help="open loop: sessions arrive at Poisson times, at this fraction of the requests a second"
        " round robin serves in a closed loop of the shape (measured first, per shape); default: closed loop",
    )
    args = parser.parse_args(argv)
    if args.load is not None and not 0 < args.load < float("inf"):
        parser.error("--load must be a positive fraction of the closed-loop rate")
    if not 0 <= args.think_ms < float("inf"):
        parser.error("--think-ms must be a finite number of milliseconds >= 0")
    shapes = [s for s in args.shapes.split(",") if s]
    seeds = (
        SEEDS[: args.seeds] if args.seeds <= len(SEEDS) else tuple(SEEDS[0] + i for i in range(args.seeds))
    )
    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    results: dict[tuple[str, str], list[RunResult]] = {}
    started = time.perf_counter()

    warm_bound: dict[str, list[int]] = {}
    capacity: dict[str, float] = {}  # requests a second, for --load
    with (
        tempfile.TemporaryDirectory(prefix="workload-") as scratch,
        ImageServer(latency=args.origin_latency_ms / 1000) as origin,
    ):
        bench = Bench(Path(scratch), model_dir(Path(scratch)), redis_url, args.kv_blocks)
        try:
            bench.start()
            for seed in seeds:
                catalogue = Catalogue(origin, f"s{seed}", args.products)
                for shape in shapes:
                    sessions = plan(shape, args.requests, seed, catalogue)
                    turns = [turn for session in sessions for turn in session]
                    warm_bound.setdefault(shape, []).append(len(turns) - len({t.prefix for t in turns}))
                    # Rotate the modes' order per seed: no mode always runs first after a reset.
                    order = [m for m in MODES[seed % 3 :] + MODES[: seed % 3] if m in args.modes.split(",")]
                    if args.noise_floor:
                        order.append(AGAIN)
                    rate = None
                    if args.load is not None:
                        if shape not in capacity:
                            calibration = bench.run(shape, "round_robin", seed, sessions)
                            capacity[shape] = len(calibration.outcomes) / calibration.wall_s
                            print(
                                f"[{shape} capacity] round robin, closed loop: "
                                f"{capacity[shape]:.2f} requests/s",
                                flush=True,
                            )
                        rate = args.load * capacity[shape] / (len(turns) / len(sessions))
                    for mode in order:
                        result = bench.run(shape, mode, seed, sessions, rate, args.think_ms / 1000)
                        results.setdefault((shape, mode), []).append(result)
                        warm, warm_p50, cold_p50 = result.split_ttft_p50()
                        print(
                            f"[{shape} {mode:<11} seed {seed}] hit {result.hit_rate:.3f} ttft p50 "
                            f"{result.ttft_p50 * 1000:.0f} ms (warm {warm}/{len(result.outcomes)} "
                            f"{warm_p50 * 1000:.0f} ms, cold {cold_p50 * 1000:.0f} ms) "
                            f"imbalance {result.imbalance:.2f} failed {len(result.failures)}",
                            flush=True,
                        )
                        for failure in result.failures[:2]:
                            print(f"  failed: {failure}", flush=True)
        finally:
            bench.close()

    hit_ratios, ttft_ratios, floors = [], [], []
    best = given_up = 0
    shown_modes = (*MODES, AGAIN) if args.noise_floor else MODES
    for shape in shapes:
        print(f"\nshape ({shape}): medians over {len(seeds)} seeds [min-max]")
        print(f"{'mode':<12} {'hit':>22} {'ttft p50 (s)':>22} {'imbalance':>22} {'given up':>9}")
        for mode in shown_modes:
            runs = results.get((shape, mode))
            if not runs:
                continue
            shape_best = sum(r.best_overlap for r in runs)
            shape_given_up = sum(r.given_up for r in runs)
            print(
                f"{mode:<12} {spread([r.hit_rate for r in runs]):>22}"
                f" {spread([r.ttft_p50 for r in runs]):>22}"
                f" {spread([r.imbalance for r in runs]):>22} {shape_given_up / max(shape_best, 1):9.3f}"
            )
            if mode == "kv":
                best += shape_best
                given_up += shape_given_up
        queueing = []
        for mode in shown_modes:
            runs = results.get((shape, mode))
            if runs:
                counts, behind, rest = zip(*(r.split_by_queue() for r in runs), strict=True)
                queueing.append(
                    f"{mode} {statistics.median(counts):.0f}/{args.requests}"
                    f" ({_median_ms(behind)} vs {_median_ms(rest)} ms)"
                )
        print(
            "arrived behind a prompt still prefilling on its worker (p50 of those vs the rest): "
            + ", ".join(queueing)
        )
        if args.load is None:
            bursts = [
                f"{mode} {statistics.median(r.burst_share(CONCURRENCY) for r in results[(shape, mode)]):.0%}"
                for mode in shown_modes
                if (shape, mode) in results
            ]
            print(
                f"arrived in a burst of all {CONCURRENCY} users (each within"
                f" {BURST_GAP_S * 1000:.0f} ms of the one before), medians: " + ", ".join(bursts)
            )
        warm_counts = [
            f"{mode} {statistics.median(r.split_ttft_p50()[0] for r in results[(shape, mode)]):.0f}"
            for mode in shown_modes
            if (shape, mode) in results
        ]
        print(
            "warm requests (half the prompt cached or more), medians: " + ", ".join(warm_counts)
            + f"; at most {statistics.median(warm_bound[shape]):.0f} for any router"
            " (every request but the first to show its prefix)"
        )  # fmt: skip
        kv, rr = results.get((shape, "kv"), []), results.get((shape, "round_robin"), [])
        again = results.get((shape, AGAIN), [])
        if again and rr:
            floor = statistics.median(r.ttft_p50 for r in again) / statistics.median(r.ttft_p50 for r in rr)
            hit_floor = statistics.median(r.hit_rate for r in again) / max(
                statistics.median(r.hit_rate for r in rr), 1e-9
            )
            per_seed = ", ".join(f"{a.ttft_p50 / r.ttft_p50:.2f}" for a, r in zip(again, rr, strict=True))
            floors.append(floor)
            print(
                f"noise floor, round robin again over round robin: ttft p50 {floor:.2f}, hit {hit_floor:.2f}"
                f" (ttft p50 per seed: {per_seed})"
            )
        by_reason: Counter[str] = Counter()
        lost: Counter[str] = Counter()
        for run in kv:
            for overlap, best_overlap, reason in run.reasons:
                by_reason[reason] += 1
                lost[reason] += best_overlap - overlap
        print(
            "kv decisions by reason (blocks given up): "
            + ", ".join(f"{reason} {count} ({lost[reason]})" for reason, count in by_reason.most_common())
        )
        if not (kv and rr):
            continue
        hit_ratio = statistics.median(r.hit_rate for r in kv) / max(
            statistics.median(r.hit_rate for r in rr), 1e-9
        )
        ttft_ratio = statistics.median(r.ttft_p50 for r in kv) / statistics.median(r.ttft_p50 for r in rr)
        hit_ratios.append(hit_ratio)
        ttft_ratios.append(ttft_ratio)
        pooled_p50, pooled_mean = (
            _pooled(kv, estimate) / _pooled(rr, estimate) for estimate in (statistics.median, statistics.mean)
        )
        print(
            f"kv/rr: hit {hit_ratio:.2f}, ttft p50 {ttft_ratio:.2f}"
            f" (every request of every seed pooled: p50 {pooled_p50:.2f}, mean {pooled_mean:.2f})"
        )
    runs = sum(len(r) for r in results.values())
    print(f"\n{runs} runs of {args.requests} requests in {time.perf_counter() - started:.0f} s")
    if floors:
        print(
            f"noise floor: round robin again over round robin, ttft p50 from {min(floors):.2f} to"
            f" {max(floors):.2f} over the shapes"
        )
    if not hit_ratios:
        return 0
    print(
        f"shapes={len(shapes)} worst_hit_kv_over_rr={min(hit_ratios):.2f}"
        f" worst_ttft_p50_kv_over_rr={max(ttft_ratios):.2f} best_ttft_p50_kv_over_rr={min(ttft_ratios):.2f}"
        f" overlap_given_up={given_up / max(best, 1):.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
