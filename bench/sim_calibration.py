"""Calibrates a simulated engine's profile on the native engine, and checks it.

The native engine serves bench/engine_batching.py's two mixes (decode-heavy and prefill-heavy,
a quarter of the requests with an image) in closed loop at a few concurrencies; every step is
timed with what it computed (prompt tokens, decoding sequences and their context), every image
encode on its own. A least-squares fit of the step times gives the profile's step_base_ms /
prefill_token_ms / decode_sequence_ms / decode_context_ms (a term that comes out negative is
dropped and the rest refitted), the median encode its image_encode_ms. The simulated engine
then replays the same load in virtual time (workers.sim_engine.replay) with the profile: it
must take the same steps, and its modelled busy time is compared with the engine's measured
one per load; its modelled mean TTFT and tok/s are printed against the wall-time ones too.

Where the engine runs decides what a step's time is:
- On the CPU (the default: the demo model, one torch thread, profile cpu-demo) the engine
  thread's CPU time: on a machine shared with other work, wall time counts the others' bursts
  too (and the wall-time TTFT and tok/s do).
- On a GPU (`--device cuda`) wall time, read after `torch.cuda.synchronize()`: the thread's CPU
  time there is launch overhead, not the kernels. The model is one of workers.demo_model's
  sizes, a published one for a profile worth having (`--size qwen2-vl-7b`: Qwen2-VL-7B's
  dimensions, random weights drawn on the GPU, 14.5 GB in bf16), built under
  var/models/demo-SIZE on first use and reused after. The KV pool takes what the device has
  left beside the weights and room for the largest step's activations.

Usage:
  .venv/bin/python bench/sim_calibration.py [--write]            # CPU, demo model -> cpu-demo
  python3 bench/sim_calibration.py --device cuda --size qwen2-vl-7b --profile qwen2-vl-7b-h200 --write

Options (a workload option's default depends on the device: CPU / GPU):
  --device cpu|cuda|cuda:N   where the engine runs (cpu)
  --dtype auto|bfloat16|float16|float32
                             the weights' dtype (auto: float32 on a CPU, the checkpoint's, bf16,
                             elsewhere)
  --size NAME                workers.demo_model size: tiny, small, medium, qwen2-vl-2b, qwen2-vl-7b
                             (tiny / qwen2-vl-7b)
  --model-dir PATH           the checkpoint (default: MODEL_PATH or var/models/demo for tiny,
                             var/models/demo-SIZE otherwise), built there if absent
  --profile NAME             the profile's name and file, profiles/NAME.json (cpu-demo on a CPU;
                             required elsewhere)
  --write                    write the fit and the measurements (as the profile's reference,
                             which tests/test_sim_calibration.py checks cpu-demo against without
                             running the model) into profiles/NAME.json
  --out PATH                 write the profile there instead (implies --write)
  --levels 1,8[,32]          closed-loop concurrencies (1,8 / 1,8,32)
  --decode-requests N        decode-heavy requests (BENCH_REQUESTS or 16 / 32)
  --decode-prompt T          their prompt tokens (256 / 1024)
  --decode-output T          their output tokens (128 / 48)
  --prefill-requests N       prefill-heavy requests (BENCH_PREFILL_REQUESTS or 8 / 16)
  --prefill-prompt T         their prompt tokens (2000 / 4000)
  --prefill-output T         their output tokens (16 / 16)
  --image-size PX            the side of a request's square image (112: 16 image tokens / 448: 256)
  --max-batch-tokens N, --max-running N, --join-tokens N
                             the engine's scheduler limits, written to the profile
                             (512, 16, 64 / 8192, 256, 512)
  --kv-blocks N              the KV pool in blocks of 16 tokens (4096 / what fits on the GPU)

Last line: `worst_busy_ratio=… worst_wall_ratio=… within_15pct=yes|no wall_within_15pct=yes|no`
(modelled ÷ measured, the furthest from 1).

Imports: torch, transformers, numpy, tokenizers, safetensors, xxhash, pillow and what they pull
in (httpx comes with transformers' huggingface_hub); no Django, Redis or Celery.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.engine_batching import REPO, build_request, demo_model_dir, run_level
from workers.sim_engine.profile import PROFILES_DIR, SimProfile
from workers.sim_engine.replay import ReplayRequest, closed_loop

TIMING_TERMS = ("step_base_ms", "prefill_token_ms", "decode_sequence_ms", "decode_context_ms")
# A GPU pool leaves room for the largest step's activations (a 7B's 8,192-token step, its
# attention over a chunk with a mask included, peaks at a few GB) and the allocator's slack.
ACTIVATION_RESERVE_BYTES = 16 << 30
GPU_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class Workload:
    levels: tuple[int, ...]
    decode_requests: int
    decode_prompt: int
    decode_output: int
    prefill_requests: int
    prefill_prompt: int
    prefill_output: int
    image_size: int
    max_batch_tokens: int
    max_running: int
    join_tokens: int


# The CPU's is the load cpu-demo was calibrated on (bench/engine_batching.py's mixes and the
# engine's default limits). The GPU's is sized for a 7B on an H200 within a few minutes: steps
# long enough not to be all launch overhead, a batch of 32 decodes, 4,000-token prompts that
# batch in twos, 448x448 images, and the scheduler limits of the H100 profile.
CPU_WORKLOAD = Workload(
    levels=(1, 8),
    decode_requests=int(os.environ.get("BENCH_REQUESTS", "16")),
    decode_prompt=256,
    decode_output=128,
    prefill_requests=int(os.environ.get("BENCH_PREFILL_REQUESTS", "8")),
    prefill_prompt=2000,
    prefill_output=16,
    image_size=112,
    max_batch_tokens=512,
    max_running=16,
    join_tokens=64,
)
GPU_WORKLOAD = Workload(
    levels=(1, 8, 32),
    decode_requests=int(os.environ.get("BENCH_REQUESTS", "32")),
    decode_prompt=1024,
    decode_output=48,
    prefill_requests=int(os.environ.get("BENCH_PREFILL_REQUESTS", "16")),
    prefill_prompt=4000,
    prefill_output=16,
    image_size=448,
    max_batch_tokens=8192,
    max_running=256,
    join_tokens=512,
)


class StepTimer:
    """Times the native engine's steps and image encodes, with what each step computed, on
    `clock` (the engine thread's CPU time, or synchronized wall time on a GPU)."""

    def __init__(self, engine: Any, clock: Callable[[], float]) -> None:
        # prompt tokens, decodes, the decodes' context, seconds (encoding apart)
        self.steps: list[tuple[int, int, int, float]] = []
        # per step, what the timing model leaves out: prompt chunks, and their (query, key) pairs
        self.details: list[tuple[int, int]] = []
        self.encodes: list[float] = []
        self.busy = 0.0  # seconds in steps and encodes, so far
        self._plan = None
        self._encoding = 0.0
        schedule, run, encode = engine.scheduler.schedule, engine.step.run, engine.runner.encode_image

        def timed_schedule():
            self._plan = schedule()
            return self._plan

        def timed_encode(image):
            started = clock()
            try:
                return encode(image)
            finally:
                spent = clock() - started
                self.encodes.append(spent)
                self._encoding += spent
                self.busy += spent

        def timed_run():
            self._plan, self._encoding = None, 0.0
            started = clock()
            run()
            seconds = clock() - started - self._encoding
            self.busy += seconds
            if self._plan is not None and self._plan.chunks:
                prompt = decodes = context = chunks = attended = 0
                for chunk in self._plan.chunks:
                    if chunk.start >= chunk.sequence.prompt_len:
                        decodes += 1
                        context += chunk.start
                    else:
                        count = min(chunk.start + chunk.count, chunk.sequence.prompt_len) - chunk.start
                        prompt += count
                        chunks += 1
                        attended += count * (chunk.start + (count + 1) // 2)  # (query, key) pairs
                self.steps.append((prompt, decodes, context, seconds))
                self.details.append((chunks, attended))

        engine.scheduler.schedule, engine.step.run, engine.runner.encode_image = (
            timed_schedule,
            timed_run,
            timed_encode,
        )

    def fit(self) -> dict[str, float]:
        # Plain least squares on the step times (weighing relative errors instead fitted the
        # prefill-heavy mix worse, 0.73x against 0.99x, in one trial each). A per-unit cost that
        # comes out negative (decodes and their context grow together) is dropped and the rest
        # refitted: clamping it to 0 would leave the others fitted to the negative one.
        rows = np.array([[1.0, p, d, c / 1000] for p, d, c, _ in self.steps])
        times = np.array([s * 1000 for *_, s in self.steps])
        kept = list(range(len(TIMING_TERMS)))
        while True:
            solution, *_ = np.linalg.lstsq(rows[:, kept], times, rcond=None)
            costs = dict(zip(kept, (float(x) for x in solution), strict=True))
            negative = [term for term in kept[1:] if costs[term] < 0]
            if not negative:
                break
            kept.remove(min(negative, key=costs.__getitem__))
        fitted = {name: costs.get(term, 0.0) for term, name in enumerate(TIMING_TERMS)}
        return {
            "step_base_ms": round(fitted["step_base_ms"], 3),
            "prefill_token_ms": round(fitted["prefill_token_ms"], 6),
            "decode_sequence_ms": round(fitted["decode_sequence_ms"], 5),
            "decode_context_ms": round(fitted["decode_context_ms"], 5),
            "image_encode_ms": round(1000 * float(np.median(self.encodes)), 2) if self.encodes else 0.0,
        }


def step_clock(device: Any) -> Callable[[], float]:
    """The engine thread's CPU time on a CPU; elsewhere wall time once the device is done."""
    import torch

    if device.type == "cpu":
        return time.thread_time
    if device.type == "cuda":

        def synchronized() -> float:
            torch.cuda.synchronize(device)
            return time.perf_counter()

        return synchronized
    return time.perf_counter


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, Workload]:
    parser = argparse.ArgumentParser(
        description="Calibrate a simulated engine's profile on the native engine (see the module docstring)."
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--size")
    parser.add_argument("--model-dir", type=Path)
    parser.add_argument("--profile")
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--steps-out", type=Path, help="every timed step, as JSON, to fit again")
    parser.add_argument("--levels")
    parser.add_argument("--kv-blocks", type=int)
    for field in Workload.__dataclass_fields__:
        if field != "levels":
            parser.add_argument("--" + field.replace("_", "-"), type=int)
    args = parser.parse_args(argv)
    on_cpu = args.device == "cpu"
    if args.profile is None:
        if not on_cpu:
            parser.error("--profile NAME is required off the CPU (e.g. qwen2-vl-7b-h200)")
        args.profile = "cpu-demo"
    if args.size is None:
        args.size = "tiny" if on_cpu else "qwen2-vl-7b"
    base = CPU_WORKLOAD if on_cpu else GPU_WORKLOAD
    chosen: dict[str, Any] = {
        field: getattr(args, field) if getattr(args, field) is not None else getattr(base, field)
        for field in Workload.__dataclass_fields__
        if field != "levels"
    }
    levels = tuple(int(n) for n in args.levels.split(",")) if args.levels else base.levels
    return args, Workload(levels=levels, **chosen)


def model_dir_for(size: str, model_dir: Path | None) -> Path:
    """The checkpoint of this demo size, built on first use."""
    from workers.demo_model import DEMO_SIZES, replace_demo_model

    if size not in DEMO_SIZES:
        raise SystemExit(f"no demo size {size!r}; choose from {', '.join(DEMO_SIZES)}")
    if model_dir is None and size == "tiny":
        return demo_model_dir()
    path = model_dir or REPO / "var" / "models" / f"demo-{size}"
    if not (path / "config.json").exists():
        started = time.perf_counter()
        print(f"building the {size} demo model into {path}", flush=True)
        replace_demo_model(path, size=size)
        print(f"built in {time.perf_counter() - started:.1f} s", flush=True)
    return path


def kv_blocks_that_fit(model_dir: Path, device: Any, dtype: str, block_size: int) -> int:
    """The KV pool's blocks on a GPU: its free memory's share, less the weights (their size on
    disk, at the dtype they load in) and room for activations, in blocks of the model's KV."""
    import torch

    from workers.engine.loading import model_dtype

    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    saved_name = next((c[k] for c in (config, text) for k in ("dtype", "torch_dtype") if c.get(k)), "float32")
    saved = getattr(torch, saved_name)
    loaded = model_dtype(dtype, on_cpu=False)
    itemsize = (saved if loaded == "auto" else loaded).itemsize
    weights = sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) * itemsize / saved.itemsize
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    block = 2 * text["num_hidden_layers"] * block_size * text["num_key_value_heads"] * head_dim * itemsize
    free, _ = torch.cuda.mem_get_info(device)
    blocks = int((free * GPU_MEMORY_SHARE - weights - ACTIVATION_RESERVE_BYTES) // block)
    if blocks < 1:
        raise SystemExit(
            f"no room for a KV pool: {free / 2**30:.1f} GiB free, weights {weights / 2**30:.1f} GiB"
        )
    return blocks


def served(engine: Any, requests: list, concurrency: int) -> Any:
    """run_level, once the engine thread is done too, and every request answered."""
    level = run_level(engine, requests, concurrency)
    # The last answer comes out of its step before the step's time is added: let the step end.
    engine.close()
    if len(level.results) != len(requests):
        raise SystemExit(
            f"{len(requests) - len(level.results)} of {len(requests)} requests failed at concurrency "
            f"{concurrency} (their tracebacks are above)"
        )
    return level


def model_facts(engine: Any, size: str) -> dict[str, Any]:
    config = engine.model.config
    text = config.get_text_config()
    vision = getattr(config, "vision_config", None)
    facts: dict[str, Any] = {
        "demo_size": size,
        "model_type": config.model_type,
        "parameters": sum(p.numel() for p in engine.model.parameters()),
        "text": {
            name: getattr(text, name)
            for name in (
                "num_hidden_layers",
                "hidden_size",
                "intermediate_size",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        },
    }
    if vision is not None:
        facts["vision"] = {
            name: getattr(vision, name)
            for name in ("depth", "embed_dim", "num_heads", "mlp_ratio", "patch_size", "spatial_merge_size")
            if hasattr(vision, name)
        }
    return facts


def main(argv: list[str] | None = None) -> None:
    args, load = parse_args(sys.argv[1:] if argv is None else argv)
    started = time.perf_counter()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    import transformers

    from workers.engine import Engine

    device = torch.device(args.device)
    on_cpu = device.type == "cpu"
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    if on_cpu:
        torch.set_num_threads(1)
    model_dir = model_dir_for(args.size, args.model_dir)
    kv_blocks = args.kv_blocks
    if kv_blocks is None:
        kv_blocks = kv_blocks_that_fit(model_dir, device, args.dtype, 16) if device.type == "cuda" else 4096
    engine = Engine.load(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        kv_capacity_blocks=kv_blocks,
        max_batch_tokens=load.max_batch_tokens,
        max_running=load.max_running,
        prefill_join_tokens=load.join_tokens,
    )
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    dtype = str(engine.model.dtype).removeprefix("torch.")
    print(
        f"{model_dir.name} ({args.size}) on {device_name} in {dtype}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}: loaded at {time.perf_counter() - started:.1f} s, "
        f"KV pool {engine.kv_pool.capacity_blocks} blocks",
        flush=True,
    )
    if device.type == "cuda":
        print(
            f"GPU memory: {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated of "
            f"{torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB",
            flush=True,
        )
    mixes = {
        "decode": [
            build_request(
                engine, n, load.decode_prompt, load.decode_output, n % 4 == 1, image_size=load.image_size
            )
            for n in range(load.decode_requests)
        ],
        "prefill": [
            build_request(
                engine,
                1000 + n,
                load.prefill_prompt,
                load.prefill_output,
                n % 4 == 1,
                image_size=load.image_size,
            )
            for n in range(load.prefill_requests)
        ],
    }
    # warm-up: first-call allocations, lazy imports, the GPU's kernels at a prefill's size too
    served(engine, [*mixes["decode"][:2], *mixes["prefill"][:1]], 2)
    print(f"requests built, engine warm at {time.perf_counter() - started:.1f} s", flush=True)
    timer = StepTimer(engine, step_clock(device))
    busy_key = "busy_cpu_s" if on_cpu else "busy_s"
    measured: dict[str, dict] = {}
    workloads: dict[str, list[list[int]]] = {}
    spans: dict[str, list[int]] = {}  # each load's steps in timer.steps
    for mix, requests in mixes.items():
        for concurrency in load.levels:
            passes, busy, first = engine.forward_passes, timer.busy, len(timer.steps)
            level = served(engine, requests, concurrency)
            measured[f"{mix}_c{concurrency}"] = {
                "ttft_mean_ms": round(statistics.fmean(r.ttft_ms for r in level.results), 2),
                "tok_s": round(level.tokens_per_s, 2),
                "forward_passes": engine.forward_passes - passes,
                busy_key: round(timer.busy - busy, 4),
            }
            print(
                f"{mix} c{concurrency}: {level.seconds:.1f} s, {measured[f'{mix}_c{concurrency}']} "
                f"(at {time.perf_counter() - started:.1f} s)",
                flush=True,
            )
            spans[f"{mix}_c{concurrency}"] = [first, len(timer.steps)]
        workloads[mix] = [[r.prompt_tokens, r.completion_tokens, r.encoder_calls] for r in level.results]
    if args.steps_out:
        # (prompt tokens, decodes, their context, seconds, prompt chunks, their (query, key) pairs)
        steps = [[*step, *detail] for step, detail in zip(timer.steps, timer.details, strict=True)]
        args.steps_out.write_text(json.dumps({"loads": spans, "steps": steps, "encodes": timer.encodes}))
    fitted = timer.fit()
    print(f"{len(timer.steps)} steps and {len(timer.encodes)} image encodes timed; fit: {json.dumps(fitted)}")

    path = args.out or PROFILES_DIR / f"{args.profile}.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    if args.write or args.out:
        data = {
            "name": args.profile,
            "description": data.get("description") or describe(args, device_name, dtype),
            "timing": fitted,
            "scheduler": {
                "max_batch_tokens": engine.scheduler.max_batch_tokens,
                "max_running": engine.scheduler.max_running,
                "policy": engine.scheduler.policy,
                "prefill_join_tokens": engine.scheduler.join_tokens,
            },
            "kv_capacity_blocks": engine.kv_pool.capacity_blocks,
            "source": {
                "machine": os.uname().nodename,
                "device": device_name,
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "dtype": dtype,
                "model": model_facts(engine, args.size),
                "step_time": "the engine thread's CPU time (time.thread_time)"
                if on_cpu
                else "wall time, read after torch.cuda.synchronize()",
                "note": "a shared 2-core machine; the fit and busy_cpu_s are the engine thread's CPU "
                "time, the wall-time figures (ttft_mean_ms, tok_s) count the neighbours' load too"
                if on_cpu
                else "random weights (workers.demo_model, the demo tokenizer's 4,096-token "
                "vocabulary); the native engine (transformers' eager forward over the paged pool), "
                "not vLLM",
            },
            "reference": {
                "measured_by": command_line(sys.argv[1:] if argv is None else argv),
                "measured": measured,
                "workloads": workloads,
            },
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        print(f"written: {path}")
    elif not data:  # nothing on file to check: check the fit
        data = {
            "name": args.profile,
            "timing": fitted,
            "scheduler": {
                "max_batch_tokens": load.max_batch_tokens,
                "max_running": load.max_running,
                "prefill_join_tokens": load.join_tokens,
            },
            "kv_capacity_blocks": engine.kv_pool.capacity_blocks,
        }
    engine.close()
    print(f"measured in {time.perf_counter() - started:.1f} s; the simulator replays the same loads:")
    report(SimProfile.from_dict(data), measured, workloads, load.levels, busy_key)


def command_line(argv: list[str]) -> str:
    """The calibration's command as the profile records it: where its file went is not part of it."""
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip or arg.startswith(("--out=", "--steps-out=")):
            skip = False
            continue
        skip = arg in ("--out", "--steps-out")
        if not skip and arg != "--write":
            kept.append(arg)
    return " ".join(["bench/sim_calibration.py", *kept, "--write"])


def describe(args: argparse.Namespace, device_name: str, dtype: str) -> str:
    timed = "the engine thread's CPU time" if args.device == "cpu" else "wall time"
    return (
        f"workers.demo_model's {args.size} (random weights, the published dimensions where the size "
        f"is a published one) in {dtype} on one {device_name}, served by the native engine "
        f"(workers.engine: transformers' eager forward over the paged KV pool), not vLLM. "
        f"Calibrated by bench/sim_calibration.py --device {args.device}: step times in {timed}."
    )


def report(
    profile: SimProfile,
    measured: dict[str, dict],
    workloads: dict[str, list[list[int]]],
    levels: tuple[int, ...],
    busy_key: str,
) -> None:
    worst_busy = worst_wall = 1.0

    def furthest(worst: float, *ratios: float) -> float:
        return max(worst, *ratios, key=lambda r: abs(r - 1))

    busy_heading = "busy cpu s" if busy_key == "busy_cpu_s" else "busy s"
    print(
        f"\n{'load':>12}{'steps':>7}{'sim':>6}{busy_heading:>12}{'modelled':>10}{'ratio':>7}"
        f"{'mean ttft ms':>14}{'modelled':>10}{'ratio':>7}{'tok/s':>8}{'modelled':>10}{'ratio':>7}"
    )
    for mix, rows in workloads.items():
        requests = [ReplayRequest(p, m, i) for p, m, i in rows]
        for concurrency in levels:
            native = measured[f"{mix}_c{concurrency}"]
            sim = closed_loop(profile, requests, concurrency)
            busy_ratio = sim.seconds / native[busy_key]
            ttft_ratio = sim.ttft_mean_ms / native["ttft_mean_ms"]
            tok_ratio = sim.tokens_per_s / native["tok_s"]
            worst_busy = furthest(worst_busy, busy_ratio)
            worst_wall = furthest(worst_wall, ttft_ratio, tok_ratio)
            print(
                f"{mix + ' c' + str(concurrency):>12}{native['forward_passes']:>7}{sim.forward_passes:>6}"
                f"{native[busy_key]:>12.2f}{sim.seconds:>10.2f}{busy_ratio:>7.2f}"
                f"{native['ttft_mean_ms']:>14.1f}{sim.ttft_mean_ms:>10.1f}{ttft_ratio:>7.2f}"
                f"{native['tok_s']:>8.1f}{sim.tokens_per_s:>10.1f}{tok_ratio:>7.2f}"
            )
    print(
        f"worst_busy_ratio={worst_busy:.3f} worst_wall_ratio={worst_wall:.3f} "
        f"within_15pct={'yes' if abs(worst_busy - 1) <= 0.15 else 'no'} "
        f"wall_within_15pct={'yes' if abs(worst_wall - 1) <= 0.15 else 'no'}"
    )


if __name__ == "__main__":
    main()
