"""vLLM's KV events in the router's terms, and a mirror of what vLLM holds.

vLLM publishes, per engine step, `BlockStored` (each block's vLLM hash, its parent's, the
blocks' token ids and, per block, `extra_keys`: the (media uuid, media start - block start)
pairs it covers and, on a prompt's first block, the cache salt), `BlockRemoved` and
`AllBlocksCleared`. Its hashes are its own (keyed on the pixel uuids this worker gave it); the
router keys blocks on `routing.prompt.hashing` with each image's routing identity. The
translator re-hashes each stored block the router's way, from its tokens and the routing hash
the worker mapped each uuid to when it built the prompt, chained from the parent's router hash.

vLLM republishes some blocks: a block already mirrored is not announced twice. Two vLLM blocks
may be one router block (the same URL identity served two pictures, so two uuids): the router's
block is announced when the first arrives and removed when the last goes. Pure: no vLLM import.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

from routing.contract.kv_events import KvEvent
from routing.prompt.hashing import local_block_hash, next_sequence_hash

logger = logging.getLogger("workers.vllm_engine")

# uuid -> routing hash entries kept for events that arrive after their request ended; a block
# whose uuid was forgotten is not announced (the router then sees less than vLLM holds).
_MEDIA_ENTRIES = 65536


class KvEventTranslator:
    """vLLM block events into `KvEvent`s for one worker, with the mirror its re-announce reads."""

    def __init__(self, worker: str, block_size: int) -> None:
        self.worker = worker
        self.block_size = block_size
        self._lock = threading.Lock()
        self._media: OrderedDict[str, int] = OrderedDict()  # pixel uuid -> routing hash
        self._blocks: dict[Hashable, int] = {}  # vLLM block hash -> router sequence hash
        self._holders: dict[int, int] = {}  # router sequence hash -> vLLM blocks standing for it
        self.untranslated = 0  # stored blocks not announced (unknown parent or uuid, other size)

    def remember_media(self, uuids: Sequence[str], routing_hashes: Sequence[int]) -> None:
        """The routing hash the router folded in for each image vLLM will know by its uuid."""
        with self._lock:
            for uuid, routing_hash in zip(uuids, routing_hashes, strict=True):
                self._media[uuid] = routing_hash
                self._media.move_to_end(uuid)
            while len(self._media) > _MEDIA_ENTRIES:
                self._media.popitem(last=False)

    def held(self) -> set[int]:
        """The router hashes of every block vLLM holds now, as far as its events said."""
        with self._lock:
            return set(self._holders)

    def translate(self, events: Sequence[Any]) -> list[KvEvent]:
        """vLLM events (BlockStored / BlockRemoved / AllBlocksCleared, in order) as KvEvents."""
        out: list[KvEvent] = []
        with self._lock:
            for event in events:
                kind = type(event).__name__
                if kind == "BlockStored":
                    stored = self._stored(event)
                    if stored is not None:
                        out.append(stored)
                elif kind == "BlockRemoved":
                    removed = self._removed(event.block_hashes)
                    if removed:
                        out.append(KvEvent("removed", self.worker, tuple(removed)))
                elif kind == "AllBlocksCleared":
                    self._blocks.clear()
                    self._holders.clear()
                    out.append(KvEvent("cleared", self.worker))
        return out

    def _stored(self, event: Any) -> KvEvent | None:
        size = event.block_size
        if size != self.block_size:
            self.untranslated += len(event.block_hashes)
            logger.warning("vLLM stored blocks of %d tokens; the router hashes %d", size, self.block_size)
            return None
        previous: int | None = None
        if event.parent_block_hash is not None:
            previous = self._blocks.get(event.parent_block_hash)
            if previous is None:  # a parent never announced: its children cannot be keyed
                self.untranslated += len(event.block_hashes)
                return None
        parent: int | None = None  # the router hash before the first newly announced block
        new_hashes: list[int] = []
        new_locals: list[int] = []
        extra_keys = event.extra_keys or [None] * len(event.block_hashes)
        for index, vllm_hash in enumerate(event.block_hashes):
            tokens = event.token_ids[index * size : (index + 1) * size]
            tags, salt = self._tags(extra_keys[index])
            if tags is None:
                self.untranslated += len(event.block_hashes) - index
                break
            local = local_block_hash(tokens, tags)
            prior, sequence = previous, next_sequence_hash(previous, local, salt)
            previous = sequence
            if vllm_hash in self._blocks:
                continue  # republished: announced already
            self._blocks[vllm_hash] = sequence
            holders = self._holders.get(sequence, 0)
            self._holders[sequence] = holders + 1
            if holders == 0:
                if not new_hashes:
                    parent = prior
                new_hashes.append(sequence)
                new_locals.append(local)
        if not new_hashes:
            return None
        return KvEvent(
            "stored", self.worker, tuple(new_hashes), parent_hash=parent, local_hashes=tuple(new_locals)
        )

    def _removed(self, vllm_hashes: Sequence[Hashable]) -> list[int]:
        gone: list[int] = []
        for vllm_hash in vllm_hashes:
            sequence = self._blocks.pop(vllm_hash, None)
            if sequence is None:
                continue  # never announced, or removed already
            holders = self._holders.get(sequence, 0) - 1
            if holders > 0:
                self._holders[sequence] = holders
            else:
                self._holders.pop(sequence, None)
                gone.append(sequence)
        return gone

    def _tags(self, extra: Sequence[Any] | None) -> tuple[list[tuple[int, int]] | None, int | None]:
        """A block's (routing hash, offset) media tags and the cache salt, from vLLM's extra keys;
        None tags when a uuid is not known here."""
        tags: list[tuple[int, int]] = []
        salt: int | None = None
        for key in extra or ():
            if isinstance(key, list | tuple) and len(key) == 2 and isinstance(key[0], str):
                routing_hash = self._media.get(key[0])
                if routing_hash is None:
                    return None, None
                tags.append((routing_hash, int(key[1])))
            elif isinstance(key, str):
                try:
                    salt = int(key, 16)  # the worker gives vLLM the salt as 16 hex digits
                except ValueError:
                    return None, None  # a LoRA name, say: not a block this platform routes
        return tags, salt
