"""The KV event a worker's cache emits when it stores, evicts or clears blocks: the one type the
worker's publisher writes and the router's index applies.

Pure: no Redis, no Django.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal


def check_worker_name(worker: str) -> str:
    # Names end up inside keys and the load tracker's `worker\\nrequest` members.
    if not worker or "\n" in worker:
        raise ValueError(f"invalid worker name {worker!r}")
    return worker


KvEventKind = Literal["stored", "removed", "cleared"]
_KINDS = ("stored", "removed", "cleared")


@dataclass(frozen=True)
class KvEvent:
    kind: KvEventKind
    worker: str
    block_hashes: tuple[int, ...] = ()  # sequence hashes, in prompt order
    parent_hash: int | None = None  # sequence hash of the block before the first stored one
    local_hashes: tuple[int, ...] = ()
    event_id: int = 0  # per worker, increasing; assigned at publication

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"unknown kv event kind {self.kind!r}")
        check_worker_name(self.worker)

    def to_dict(self) -> dict[str, Any]:
        # JSON keeps u64s exact (Python ints); JavaScript readers should treat them as strings.
        return {
            "kind": self.kind,
            "worker": self.worker,
            "block_hashes": list(self.block_hashes),
            "parent_hash": self.parent_hash,
            "local_hashes": list(self.local_hashes),
            "event_id": self.event_id,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KvEvent:
        parent = data.get("parent_hash")
        return cls(
            kind=data["kind"],
            worker=str(data["worker"]),
            block_hashes=tuple(int(h) for h in data.get("block_hashes", ())),
            parent_hash=None if parent is None else int(parent),
            local_hashes=tuple(int(h) for h in data.get("local_hashes", ())),
            event_id=int(data.get("event_id", 0)),
        )
