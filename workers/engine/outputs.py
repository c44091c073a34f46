"""The native engine's output processing: each chosen token becomes text for its caller, and a
finished request its `GenerationResult`.

Runs in the engine thread; it only puts events on the request's queue (`workers.engine.api`),
so callbacks run in the caller's thread, never the model's.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from workers.detokenizer import TextStream
from workers.engine.api import DONE, ERROR, FIRST, TOKEN, GenerationResult
from workers.engine.counters import EngineCounters
from workers.engine.inputs import RequestState
from workers.scheduler import Scheduler, SequenceState


class OutputProcessor:
    """Streams text, stop strings and log probabilities; finishes and fails requests."""

    def __init__(
        self,
        *,
        tokenizer: Any,
        scheduler: Scheduler,
        eos_ids: frozenset[int],
        counters: EngineCounters,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.counters = counters

    def attach_stream(self, state: RequestState) -> None:
        """The request's incremental detokenizer, sending its pieces to the request's queue."""
        state.stream = TextStream(
            self.tokenizer,
            list(state.request.stop),
            functools.partial(self._send_piece, state),
            prior=state.request.continued_token_ids,
        )

    def accept(self, sequence: SequenceState, token: int) -> None:
        state: RequestState = sequence.payload
        sequence.tokens.append(token)
        self.counters.generated_tokens += 1
        if state.first_token_at is None:
            state.first_token_at = time.perf_counter()
            state.events.put((FIRST, state.first_token_at))
        if token in self.eos_ids and not state.request.ignore_eos:
            state.stream.finish()
            self.finish(sequence, "stop")
        elif state.stream.accept(token):
            self.finish(sequence, "stop")  # a stop string
        elif sequence.generated >= sequence.max_tokens:
            state.stream.finish()
            self.finish(sequence, "length")

    def finish(self, sequence: SequenceState, finish_reason: str, *, release: bool = True) -> None:
        state: RequestState = sequence.payload
        if release:
            self.scheduler.finish(sequence)
        if finish_reason == "stop" and sequence.cancelled:
            state.stream.finish()
        finished = time.perf_counter()
        first = state.first_token_at or finished
        state.events.put(
            (
                DONE,
                GenerationResult(
                    text=state.stream.text,
                    finish_reason=finish_reason,
                    prompt_tokens=sequence.prompt_len,
                    completion_tokens=state.stream.completion_tokens,
                    cached_tokens=sequence.cached_tokens or 0,
                    ttft_ms=(first - state.submitted_at) * 1000,
                    prefill_ms=(first - state.submitted_at) * 1000,
                    total_ms=(finished - state.submitted_at) * 1000,
                    encoder_calls=state.encoder_calls,
                    embedding_cache_hits=state.embedding_hits,
                    embedding_cache_misses=state.embedding_misses,
                    block_hashes=sequence.sequence_hashes,
                    preemptions=sequence.preemptions,
                    embeddings_received=state.embeddings_received,
                    embedding_fallbacks=state.embedding_fallbacks,
                    logprobs=self._logprobs(state) if state.request.logprobs else None,
                ),
            )
        )

    def fail(self, sequence: SequenceState, exc: Exception) -> None:
        self.scheduler.finish(sequence)
        sequence.payload.events.put((ERROR, exc))

    def _send_piece(self, state: RequestState, piece: str, tokens: int) -> None:
        """A piece of the answer's text to the caller, with the log probabilities of its tokens."""
        logprobs = None
        if state.request.logprobs:
            start = len(state.logprob_entries)
            logprobs = self._logprob_entries(state, start, start + tokens)
            state.logprob_entries.extend(logprobs)
        token_ids = state.stream.generated_ids[state.tokens_streamed : state.tokens_streamed + tokens]
        state.tokens_streamed += tokens
        state.events.put((TOKEN, (piece, logprobs, token_ids)))

    def _logprobs(self, state: RequestState) -> list[dict[str, Any]]:
        """The sampler's log probabilities in OpenAI's shape, one per token of the answer: those
        streamed with the pieces, then those of tokens no piece carried (a stop string's)."""
        streamed = state.logprob_entries
        return streamed + self._logprob_entries(state, len(streamed), state.stream.completion_tokens)

    def _logprob_entries(self, state: RequestState, start: int, end: int) -> list[dict[str, Any]]:
        def entry(token: int, logprob: float) -> dict[str, Any]:
            text = self.tokenizer.decode([token])
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        return [
            {**entry(chosen.token, chosen.logprob), "top_logprobs": [entry(t, lp) for t, lp in chosen.top]}
            for chosen in state.sampler.logprobs[start:end]
        ]
