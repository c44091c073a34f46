"""One step of the native engine: one forward pass over every running request's next token plus
chunks of waiting prompts (`workers.scheduler` chooses them, `workers.model_runner` runs them),
then each sampling request's token (`workers.sampler`), handed to the output processor.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from workers.engine.counters import RATE_MIN_PROMPT_TOKENS, EngineCounters
from workers.engine.inputs import RequestState
from workers.engine.outputs import OutputProcessor
from workers.engine.vision import VisionStage
from workers.sampler import choose_tokens
from workers.scheduler import ScheduledChunk, Scheduler

if TYPE_CHECKING:
    import torch

    from workers.model_runner import ChunkInput, ModelRunner


class EngineStep:
    """Schedules, packs and runs one step; the engine thread calls `run` while there is work."""

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        runner: ModelRunner,
        vision: VisionStage,
        outputs: OutputProcessor,
        counters: EngineCounters,
        block_size: int,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.vision = vision
        self.outputs = outputs
        self.counters = counters
        self.block_size = block_size

    def run(self) -> None:
        started = time.perf_counter()
        for sequence in self.scheduler.drop_cancelled():
            self.outputs.finish(sequence, "stop", release=False)
        plan = self.scheduler.schedule()
        self.counters.preemptions += len(plan.preempted)
        self.counters.running_peak = max(self.counters.running_peak, len(self.scheduler.running))
        chunks: list[ScheduledChunk] = []
        inputs: list[ChunkInput] = []
        for chunk in plan.chunks:
            try:
                inputs.append(self._chunk_input(chunk))
            except Exception as exc:  # this request's image failed to load or encode
                self.outputs.fail(chunk.sequence, exc)
                continue
            chunks.append(chunk)
        if not chunks:
            if not plan.chunks and not self.scheduler.running and self.scheduler.waiting:
                # Cannot happen for an admitted request (it fits an empty pool); never spin on it.
                self.outputs.fail(
                    self.scheduler.waiting[0], RuntimeError("the KV pool cannot hold this request")
                )
            return
        logits = self.runner.run(inputs)
        self.counters.forward_passes += 1
        prompt_tokens = sum(
            min(chunk.start + chunk.count, chunk.sequence.prompt_len) - chunk.start
            for chunk in chunks
            if chunk.start < chunk.sequence.prompt_len
        )
        for chunk in chunks:
            self.scheduler.computed(chunk)
        if prompt_tokens >= RATE_MIN_PROMPT_TOKENS:
            # Images encoded between steps count: the router drains a prompt at this rate.
            elapsed = time.perf_counter() - started + self.counters.encoder_seconds
            self.counters.note_prefill_rate(prompt_tokens, elapsed)
            self.counters.encoder_seconds = 0.0
        sampling = [chunk.sequence for chunk in chunks if chunk.samples]
        tokens = choose_tokens([sequence.payload.sampler for sequence in sampling], logits)
        for sequence, token in zip(sampling, tokens, strict=True):
            self.outputs.accept(sequence, token)

    def _chunk_input(self, chunk: ScheduledChunk) -> ChunkInput:
        from workers.model_runner import ChunkInput

        sequence = chunk.sequence
        state: RequestState = sequence.payload
        end = chunk.start + chunk.count
        if sequence.copy_from is not None:
            last_prompt_block = sequence.block_ids[(sequence.prompt_len - 1) // self.block_size]
            self.runner.copy_block(sequence.copy_from, last_prompt_block)
            sequence.copy_from = None
        image_rows: list[tuple[int, torch.Tensor]] = []
        for index, image in enumerate(state.placed):
            if image.end <= chunk.start or image.start >= end:
                continue  # outside the chunk (inside the reused prefix, say): not even looked up
            runs = image.placeholder_rows(chunk.start, end)
            if not runs:
                continue  # only a video's timestamp text is in this chunk
            embedding = self.vision.image_embedding(state, index)
            # An image cut by the prefix or a chunk boundary gives only its rows inside (trap 5).
            for position, row, count in runs:
                image_rows.append((position - chunk.start, embedding[row : row + count]))
        return ChunkInput(
            tokens=sequence.tokens[chunk.start : end],
            start=chunk.start,
            block_ids=sequence.block_ids,
            prompt_len=sequence.prompt_len,
            mrope=state.mrope,
            rope_delta=state.rope_delta,
            image_rows=image_rows,
            sample=chunk.samples,
        )
