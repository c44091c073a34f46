"""The frontend's own CPU per chat request, against simulated workers (issue 36): what one web
process spends to admit, tokenize, hash, route and answer a request whose generation costs it
nothing, so that the figure is the frontend's alone.

Two simulated workers (`run_worker --engine sim --count 2`, another process) serve the demo
model; the frontend runs in this process, and the requests are driven straight into its API
handler (`ApiHandler`, as bench/api_handler.py does: no socket, no server), one at a time, each
`max_tokens` 1 and not streamed. CPU is `time.process_time()` of this process (every thread: the
hand-overs' threads count), over REQUESTS requests per round; the figure is the median of the
rounds. Three requests:
  text       a short question;
  image      a 300-word system prompt and a 448x448 PNG sent as a data URL (issue 36's item 4), a
             new question each time so that no answer is cached anywhere; the picture is the same
             each time, as a chat client sends a conversation's pictures with every turn (the
             frontend keeps it decoded: MEDIA_DATA_URL_CACHE_MB);
  image_new  the same, with a picture never sent before each time (the same pixels and a text
             chunk of its own: as many bytes to decode as `image`'s first sight).

Usage: `.venv/bin/python bench/frontend_cpu.py [--requests N] [--rounds N] [--kinds text,image]`
(Redis at REDIS_URL, default redis://127.0.0.1:6379/14, under a namespace of its own that is
deleted afterwards; `--kinds` runs some of the three). A shared machine moves the figures; the
spread of the rounds is printed. Last line (the kinds run):
    frontend_cpu_ms_text=<x.xx> frontend_cpu_ms_image=<x.xx> frontend_cpu_ms_image_new=<x.xx>

Before and after: `--baseline-ref REF [--pairs N]` runs REF's own copy of this bench (in a git
worktree of REF, with this checkout's .venv) and this checkout's, each in a process of its own,
one after the other N times (default 3), and prints each kind's figures side by side with the
ratio of their medians (this checkout's over REF's), for the kinds both print. REF's bench runs
every kind it has (an older one has no --kinds), and so does this checkout's, besides those
asked: what else a process served moves a kind's figure. Issue 36's
"before" is 5fd36e0, the commit that added this bench: its `image` sent the same picture each
time and decoded it each time, `image_new`'s work now, so where REF's bench has no `image_new`
this checkout's is set against REF's `image` as well. Last line:
    frontend_cpu_ms_<kind>=<x.xx> baseline_ms_<kind>=<x.xx> ratio_<kind>=<x.xxx> ... (each kind)
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.api_handler import asgi_scope, serve  # noqa: E402
from bench.samples import demo_model_dir, noise_png  # noqa: E402
from tests.platform_harness import PlatformProcesses  # noqa: E402

SYSTEM_PROMPT = " ".join(f"rule{k % 97} applies to every answer about the catalogue" for k in range(38))[
    : 300 * 6
]  # ~300 words


KINDS = ("text", "image", "image_new")


def _picture_of_its_own(png: bytes, k: int) -> bytes:
    """`png` with a tEXt chunk naming `k` after its header: a picture no earlier request sent."""
    chunk = b"tEXt" + b"bench\0" + str(k).encode()
    own = struct.pack(">I", len(chunk) - 4) + chunk + struct.pack(">I", zlib.crc32(chunk))
    return png[:33] + own + png[33:]  # the signature (8 bytes), then IHDR (25)


def _bodies(kind: str, png: bytes, count: int, start: int) -> list[bytes]:
    image_url = "data:image/png;base64," + base64.b64encode(png).decode()
    out = []
    for k in range(start, start + count):
        question = f"Question {k}: what does item {k * 7919 % 100_003} look like?"
        if kind == "text":
            messages = [{"role": "user", "content": question}]
        else:
            if kind == "image_new":
                image_url = "data:image/png;base64," + base64.b64encode(_picture_of_its_own(png, k)).decode()
            messages = [
                {"role": "system", "content": SYSTEM_PROMPT},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": image_url}},
                        {"type": "text", "text": question},
                    ],
                },
            ]
        out.append(json.dumps({"model": "demo", "messages": messages, "max_tokens": 1}).encode())
    return out


async def _cpu_ms_per_request(app, key: str, bodies: list[bytes]) -> float:
    started = time.process_time()
    for body in bodies:
        status, answer = await serve(app, asgi_scope("/v1/chat/completions", key, "POST", body), body)
        if status != 200:
            raise RuntimeError(f"the chat request answered {status}: {answer[:300]!r}")
    return (time.process_time() - started) * 1000 / len(bodies)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=150, help="requests per kind per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--kinds", default=",".join(KINDS), help=f"which requests, comma-separated (of {', '.join(KINDS)})"
    )
    parser.add_argument("--baseline-ref", help="a git ref to measure before this checkout, in turn with it")
    parser.add_argument("--pairs", type=int, default=3, help="with --baseline-ref: runs of each, in turn")
    args = parser.parse_args()
    kinds = [kind for kind in args.kinds.split(",") if kind]
    if not kinds or set(kinds) - set(KINDS):
        parser.error(f"--kinds takes some of {', '.join(KINDS)}")
    if args.baseline_ref:
        return before_and_after(args.baseline_ref, args.pairs, kinds, args.rounds, args.requests)

    redis_url = os.environ.get("REDIS_URL") or "redis://127.0.0.1:6379/14"
    namespace = f"bench:fcpu:{uuid.uuid4().hex[:10]}:"
    model = demo_model_dir()
    png = noise_png("frontend-cpu", 448)
    with tempfile.TemporaryDirectory(prefix="bench-frontend-cpu-") as tmp:
        platform = PlatformProcesses(Path(tmp), model, redis_url, namespace, {"LOG_LEVEL": "WARNING"})
        try:
            names = platform.start_sim_workers("sim", 2)
            platform.wait_for_workers(*names)
            for name, value in platform.env.items():  # this process is the platform's frontend
                if os.environ.get(name) != value:
                    os.environ[name] = value
            import django

            django.setup()
            from inference_platform.api.handler import ApiHandler

            app = ApiHandler()

            async def run() -> dict[str, list[float]]:
                figures: dict[str, list[float]] = {kind: [] for kind in kinds}
                sent = 0
                for kind in figures:  # warm: imports, the model card, the first connections
                    await _cpu_ms_per_request(app, platform.api_key, _bodies(kind, png, 10, sent))
                    sent += 10
                for _ in range(args.rounds):
                    for kind, values in figures.items():
                        bodies = _bodies(kind, png, args.requests, sent)
                        sent += args.requests
                        values.append(await _cpu_ms_per_request(app, platform.api_key, bodies))
                return figures

            figures = asyncio.run(run())
        finally:
            platform.close()
    for kind, values in figures.items():
        print(f"{kind:9} frontend CPU per request: median {statistics.median(values):.2f} ms over "
              f"{args.rounds} rounds of {args.requests} [{min(values):.2f}-{max(values):.2f}]")  # fmt: skip
    medians = {kind: statistics.median(values) for kind, values in figures.items()}
    print(" ".join(f"frontend_cpu_ms_{kind}={median:.2f}" for kind, median in medians.items()))
    return 0


def before_and_after(ref: str, pairs: int, kinds: list[str], rounds: int, requests: int) -> int:
    """REF's copy of this bench and this checkout's, each in a process of its own, in turn."""
    commit = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    sizes = ["--rounds", str(rounds), "--requests", str(requests)]
    figures: dict[str, dict[str, list[float]]] = {"baseline": {}, "ours": {}}
    with tempfile.TemporaryDirectory(prefix="bench-frontend-cpu-baseline-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(tree), commit], check=True
        )
        try:
            (tree / ".venv").symlink_to(REPO / ".venv")
            for pair in range(pairs):
                # REF's bench may not know --kinds: it runs every kind it has. This checkout's
                # runs those too, besides the kinds asked: a kind's figure depends on what else
                # the process served (its caches, its heap), so both sides serve the same.
                theirs = _run_bench(tree, sizes)
                same = [kind for kind in KINDS if kind in theirs or kind in kinds]
                ours = _run_bench(REPO, [*sizes, "--kinds", ",".join(same)])
                for side, got in (("baseline", theirs), ("ours", ours)):
                    for kind, ms in got.items():
                        figures[side].setdefault(kind, []).append(ms)
                    print(f"pair {pair + 1} {side:8} " + " ".join(f"{k}={v:.2f}" for k, v in got.items()))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False)
    named = ref if commit.startswith(ref) else f"{ref} ({commit[:7]})"
    # A ref whose bench has no image_new predates the decoded pictures kept: its image decoded
    # the picture each time, image_new's work, which is set against it too.
    compared = [(kind, kind) for kind in kinds if kind in figures["baseline"] and kind in figures["ours"]]
    if (
        "image_new" in figures["ours"]
        and "image_new" not in figures["baseline"]
        and "image" in figures["baseline"]
    ):
        compared.append(("image_new", "image"))
    if not compared:
        print(f"{named} printed none of {', '.join(kinds)}: nothing to compare")
        return 1
    last = []
    for kind, theirs in compared:
        ours, base = statistics.median(figures["ours"][kind]), statistics.median(figures["baseline"][theirs])
        print(
            f"{kind:9} {ours:.2f} ms against {base:.2f} ms ({theirs}) at {named}: {ours / base:.3f}x "
            f"(medians of {pairs} runs each; ours {_spread(figures['ours'][kind])}, "
            f"{named}'s {_spread(figures['baseline'][theirs])})"
        )
        last.append(
            f"frontend_cpu_ms_{kind}={ours:.2f} baseline_ms_{kind}={base:.2f} ratio_{kind}={ours / base:.3f}"
        )
    print(" ".join(last))
    return 0


def _run_bench(root: Path, options: list[str]) -> dict[str, float]:
    """One run of the bench in checkout `root`: the figures of its last line, by kind."""
    done = subprocess.run(
        [sys.executable, str(root / "bench" / "frontend_cpu.py"), *options],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"bench/frontend_cpu.py in {root} failed ({done.returncode}): {done.stderr[-2000:]}"
        )
    return {
        name.removeprefix("frontend_cpu_ms_"): float(value)
        for name, _, value in (field.partition("=") for field in lines[-1].split())
    }


def _spread(values: list[float]) -> str:
    return f"{min(values):.2f}-{max(values):.2f}"


if __name__ == "__main__":
    sys.exit(main())
