"""Generated token ids to streamed text: whole characters only, stop strings cut and never sent."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

# Tokens decoded before the first new one when an answer is continued: enough for any character
# split across byte-level pieces (as vLLM's incremental detokenizer starts).
_PRIOR_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns generated token ids into text pieces as they arrive.

    It decodes a short window of ids: a multi-byte character split across byte-level BPE pieces
    decodes to U+FFFD until its last piece arrives, and is only emitted then.
    """

    def __init__(self, tokenizer: Any, prior: Sequence[int] = ()) -> None:
        """`prior`: tokens whose text was already sent (an answer continued after a migration);
        their text is context for the next token's, never sent again."""
        self._tokenizer = tokenizer
        self.ids: list[int] = list(prior)
        # A few tokens of context before the read point, as at any point of a running answer.
        self._prefix_offset = max(0, len(self.ids) - _PRIOR_CONTEXT_TOKENS)
        self._read_offset = len(self.ids)
        # ids[prefix_offset:read_offset] decoded: one decode per token, not two
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset) if self.ids else ""

    def push(self, token: int) -> str:
        """Adds a token; returns the text it completes (often empty for a partial character)."""
        self.ids.append(token)
        prefix_text = self._prefix_text
        new_text = self._decode(self._prefix_offset, len(self.ids))
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.ids)
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
            return new_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        prefix_text = self._prefix_text
        new_text = self._decode(self._prefix_offset, len(self.ids))
        self._prefix_offset = self._read_offset = len(self.ids)
        self._prefix_text = ""
        return new_text[len(prefix_text) :]

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self.ids[start:end], skip_special_tokens=True)


class TextStream:
    """A request's output text: sends pieces as they are decoded, holding back any tail that could
    still become a stop string, and ends the text at the first stop string.

    `send(piece, tokens)` also says how many generated tokens the piece completes: a token goes
    with the piece that carries the last character of its text (a token holding only part of a
    character goes with the token that completes it). Tokens whose text is never sent (a stop
    string's) are counted by no piece."""

    def __init__(
        self, tokenizer: Any, stops: list[str], send: Callable[[str, int], None], prior: Sequence[int] = ()
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prior)
        self._prior = len(prior)  # tokens of a continued answer, already sent by another worker
        self._stops = [stop for stop in stops if stop]
        self._send_piece = send
        self._text = ""  # decoded so far
        self._sent = 0  # characters of _text sent
        self._token_ends: list[int] = []  # per token whose text appeared: where it ends in _text
        self._textless = 0  # tokens accepted whose text has not appeared yet
        self._tokens_sent = 0  # tokens counted by the pieces sent
        self.text = ""  # the final text, set when finished

    @property
    def completion_tokens(self) -> int:
        return len(self._detokenizer.ids) - self._prior

    @property
    def generated_ids(self) -> list[int]:
        """The tokens generated here, in order (a continued answer's prior tokens excluded)."""
        return self._detokenizer.ids[self._prior :]

    def accept(self, token: int) -> bool:
        """Adds a generated token; True when a stop string has ended the text."""
        self._textless += 1
        self._append(self._detokenizer.push(token))
        return self._check_stops()

    def finish(self) -> None:
        """The end of generation: sends what was held back."""
        self._append(self._detokenizer.flush())
        if not self._check_stops():
            self._send(len(self._text))
            self.text = self._text

    def _append(self, piece: str) -> None:
        if piece:
            self._text += piece
            self._token_ends.extend([len(self._text)] * self._textless)
            self._textless = 0

    def _check_stops(self) -> bool:
        for stop in self._stops:
            # Only a match reaching into unsent text is new; earlier text was already checked.
            found = self._text.find(stop, max(0, self._sent - len(stop) + 1))
            if found != -1:
                self._text = self._text[:found]
                self._send(len(self._text))
                self.text = self._text
                return True
        self._send(len(self._text) - self._held_back())
        return False

    def _held_back(self) -> int:
        """Length of the text's longest tail that starts some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._text)), longest, -1):
                if self._text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def _send(self, upto: int) -> None:
        if upto > self._sent:
            piece = self._text[self._sent : upto]
            self._sent = upto
            tokens = 0
            ends = self._token_ends
            while self._tokens_sent + tokens < len(ends) and ends[self._tokens_sent + tokens] <= upto:
                tokens += 1
            self._tokens_sent += tokens
            self._send_piece(piece, tokens)
