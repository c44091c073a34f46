"""A model's routing card: the files the frontend's view of its prompts is built from, and the
fingerprint that names them (as Dynamo's model card names what a frontend needs of a model).

A worker reads the card from its model directory and announces the fingerprint in its heartbeat;
it publishes the files under that fingerprint (routing.fleet.model_cards), so a frontend on
another host builds the same view without the directory. The fingerprint is also the model's
KV partition (routing.prompt.hashing.partition_salt): two models never share a block hash.
Both engines' workers compute it here, from the files, never from a loaded processor.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import xxhash

from routing.prompt.layouts import FAMILY_NAMES

# What routing reads of a checkpoint (routing.prompt.model_view, layouts, video_layouts): the
# tokenizer, the chat template wherever it lives, and the processors' settings. Weights are not
# routing's business: two checkpoints that differ only in weights route alike.
ROUTING_FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)


@dataclass(frozen=True)
class ModelCard:
    family: str  # config.json's model_type
    fingerprint: str  # 32 hex digits: xxh3-128 of the routing files, names and contents
    files: dict[str, bytes]  # file name -> contents, only the ROUTING_FILES present

    @property
    def family_name(self) -> str:
        """The support matrix's name for the family, or the model type itself outside it."""
        return FAMILY_NAMES.get(self.family, self.family)


def card_fingerprint(files: dict[str, bytes]) -> str:
    """The fingerprint of a set of routing files: each name and content, length-prefixed, in order."""
    digest = xxhash.xxh3_128()
    for name in sorted(files):
        content = files[name]
        for part in (name.encode(), content):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def read_model_card(path: Path) -> ModelCard:
    """The card of the model directory at `path` (FileNotFoundError without its config.json)."""
    files = {name: (path / name).read_bytes() for name in ROUTING_FILES if (path / name).is_file()}
    if "config.json" not in files:
        raise FileNotFoundError(f"no config.json in the model directory {path}")
    return card_from_files(files)


def card_from_files(files: dict[str, bytes]) -> ModelCard:
    """A card made of files read back (from Redis): its fingerprint recomputed, never trusted,
    and no file but the routing files kept (a name is a path on the frontend's disk)."""
    files = {name: content for name, content in files.items() if name in ROUTING_FILES}
    family = str(json.loads(files.get("config.json", b"{}") or b"{}").get("model_type", ""))
    return ModelCard(family=family, fingerprint=card_fingerprint(files), files=dict(files))
