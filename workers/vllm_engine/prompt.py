"""The prompt a vLLM engine is given, from the router's token view, and the check that vLLM laid
it out as the router did.

vLLM takes a `TokensPrompt` with ONE placeholder per image and expands it itself; a prompt whose
placeholders are already expanded is not checked by vLLM (64 pads became 127 in a test, with a
wrong answer and no error), so such a prompt is refused here. vLLM keys its prefix cache on
`multi_modal_uuids` and trusts them completely (other pixels under a known uuid got the cached
blocks), so the uuid is the pixels' own hash, never a caller's or a URL's identity.

After vLLM expands the prompt, the worker hashes its `prompt_token_ids` as the router hashed its
token view (`routing.prompt.hashing`, each image folded in by the task's routing identity) and
compares: a difference means the router's overlaps and vLLM's cache disagree for this model
family, and the request fails naming it rather than answer as if nothing were wrong.

Pure: no vLLM import, so the main test suite runs it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash
from PIL import Image

from routing.media.images import pixel_identity, routing_hash
from routing.prompt.hashing import MediaPlacement, block_hashes
from workers.engine.api import EngineFailure
from workers.prompt_layout import PromptError


class PromptLayoutMismatch(EngineFailure):
    """vLLM laid the prompt out differently from the router: its overlaps would be wrong."""

    code = "prompt_layout_mismatch"


@dataclass(frozen=True)
class EngineVideo:
    """A video as vLLM takes it: the frontend's sampled frames, already resized for the model,
    with the metadata its processor needs (Qwen3-VL's timestamps come from the rate and the frame
    indices), and the token run the router expanded its placeholder into."""

    frames: Any  # numpy uint8 (frames, height, width, 3)
    fps: float  # the clip's own rate
    total_frames: int
    indices: tuple[int, ...]  # the sampled frames' places in the clip
    identity: str  # the task's identity of the video (the router's)
    expansion: tuple[int, ...]  # the router's token run for its placeholder

    @property
    def uuid(self) -> str:
        """vLLM's cache key: the frames' own hash, never the task's word for them."""
        digest = xxhash.xxh3_128()
        digest.update(repr(tuple(self.frames.shape)).encode())
        digest.update(self.frames.tobytes())
        return "video-" + digest.hexdigest()

    def as_vllm(self) -> tuple[Any, dict[str, Any]]:
        metadata = {
            "fps": self.fps,
            "total_num_frames": self.total_frames,
            "frames_indices": list(self.indices),
            "duration": self.total_frames / self.fps,
            "do_sample_frames": False,
        }
        return self.frames, metadata


@dataclass(frozen=True)
class EnginePrompt:
    """What goes to vLLM for one request (a `TokensPrompt` once `as_tokens_prompt` builds it)."""

    token_ids: list[int]  # one placeholder per image
    images: list[Image.Image]
    uuids: list[str]  # per image, from its pixels
    routing_hashes: list[int]  # per image, from the task's identity: what the router folded in
    # The caller's cache partition as 16 hex digits: vLLM folds it into the first block's hash,
    # so one tenant's prefix is never another's (and its KV events carry it back).
    cache_salt: str | None = None
    videos: list[EngineVideo] = field(default_factory=list)
    video_uuids: list[str] = field(default_factory=list)

    @property
    def media_uuids(self) -> list[str]:
        return [*self.uuids, *self.video_uuids]

    @property
    def media_routing_hashes(self) -> list[int]:
        return [*self.routing_hashes, *(routing_hash(video.identity) for video in self.videos)]

    def as_tokens_prompt(self) -> dict:
        prompt: dict = {"prompt_token_ids": list(self.token_ids)}
        if self.cache_salt is not None:
            prompt["cache_salt"] = self.cache_salt
        data: dict[str, list] = {}
        uuids: dict[str, list[str]] = {}
        if self.images:
            data["image"], uuids["image"] = list(self.images), list(self.uuids)
        if self.videos:
            data["video"] = [video.as_vllm() for video in self.videos]
            uuids["video"] = list(self.video_uuids)
        if data:
            prompt["multi_modal_data"], prompt["multi_modal_uuids"] = data, uuids
        return prompt


def engine_prompt(
    token_ids: Sequence[int],
    image_token_id: int,
    images: Sequence[Image.Image],
    identities: Sequence[str],
    salt: int | None = None,
    continued: Sequence[int] = (),
    videos: Sequence[EngineVideo] = (),
    video_token_id: int | None = None,
) -> EnginePrompt:
    """The prompt for vLLM: the chat-templated prompt's token ids with one placeholder per image
    and video, then the tokens of an answer continued after a migration (`continued`: generation
    goes on after them), the decoded images and sampled videos, their pixel uuids, and the
    routing hashes of the task's identities."""
    if videos:
        if video_token_id is None:
            raise PromptError("this model takes no video")
        video_runs = placeholder_runs(token_ids, video_token_id)
        if len(video_runs) != len(videos):
            raise PromptError(f"the prompt has {len(video_runs)} video placeholders for {len(videos)} videos")
        if any(length != 1 for _, length in video_runs):
            raise PromptError("the prompt's video placeholders are already expanded; send one per video")
    if image_token_id in continued or (video_token_id is not None and video_token_id in continued):
        raise EngineFailure(
            "this answer cannot be continued on vLLM: its generated tokens hold an image or video "
            "placeholder, which vLLM would take for another picture or clip"
        )
    runs = placeholder_runs(token_ids, image_token_id)
    if len(runs) != len(images):
        raise PromptError(f"the prompt has {len(runs)} image placeholders for {len(images)} images")
    expanded = [length for _, length in runs if length != 1]
    if expanded:
        # vLLM expands each placeholder itself and does not check a pre-expanded run.
        raise PromptError(
            f"the prompt's image placeholders are already expanded ({expanded[0]} in a row); "
            "send one placeholder per image"
        )
    return EnginePrompt(
        token_ids=[*token_ids, *continued],
        images=list(images),
        uuids=[pixel_identity(image) for image in images],
        routing_hashes=[routing_hash(identity) for identity in identities],
        cache_salt=None if salt is None else f"{salt:016x}",
        videos=list(videos),
        video_uuids=[video.uuid for video in videos],
    )


def placeholder_runs(token_ids: Sequence[int], placeholder_id: int) -> list[tuple[int, int]]:
    """(start, length) of each run of consecutive placeholder tokens, in order."""
    runs: list[tuple[int, int]] = []
    start = None
    for position, token in enumerate(token_ids):
        if token == placeholder_id:
            if start is None:
                start = position
        elif start is not None:
            runs.append((start, position - start))
            start = None
    if start is not None:
        runs.append((start, len(token_ids) - start))
    return runs


def expanded_block_hashes(
    expanded_ids: Sequence[int],
    image_token_id: int,
    routing_hashes: Sequence[int],
    block_size: int,
    salt: int | None,
    videos: Sequence[EngineVideo] = (),
    video_token_id: int | None = None,
) -> list[int]:
    """The routing block hashes of vLLM's expanded prompt: each placeholder run is one image, in
    order, folded in by the routing hash the router used for it; each video is the router's token
    run for it (Qwen3-VL's holds timestamps and vision markers between its groups), found where
    vLLM put its first placeholder and required to be that run exactly."""
    runs = placeholder_runs(expanded_ids, image_token_id)
    if len(runs) != len(routing_hashes):
        raise PromptLayoutMismatch(
            f"vLLM's prompt has {len(runs)} image runs for {len(routing_hashes)} images"
        )
    media = [
        MediaPlacement(hash_, start, length)
        for hash_, (start, length) in zip(routing_hashes, runs, strict=True)
    ]
    media += _video_placements(expanded_ids, videos, video_token_id)
    media.sort(key=lambda placement: placement.start)
    return block_hashes(expanded_ids, block_size, media, salt=salt)


def _video_placements(
    expanded_ids: Sequence[int], videos: Sequence[EngineVideo], video_token_id: int | None
) -> list[MediaPlacement]:
    placements: list[MediaPlacement] = []
    cursor = 0
    for number, video in enumerate(videos):
        assert video_token_id is not None, "a video needs its placeholder token"
        run = list(video.expansion)
        try:
            first_pad = expanded_ids.index(video_token_id, cursor)
        except ValueError:
            raise PromptLayoutMismatch(f"vLLM's prompt has no run for video {number}") from None
        start = first_pad - run.index(video_token_id)
        if start < cursor or list(expanded_ids[start : start + len(run)]) != run:
            raise PromptLayoutMismatch(
                f"vLLM expanded video {number} differently from the router ({len(run)} tokens there)"
            )
        placements.append(MediaPlacement(routing_hash(video.identity), start, len(run)))
        cursor = start + len(run)
    if video_token_id is not None and video_token_id in expanded_ids[cursor:]:
        raise PromptLayoutMismatch(f"vLLM's prompt holds more video runs than the {len(videos)} videos")
    return placements


def check_block_hashes(
    expected: Sequence[int], actual: Sequence[int], *, model_type: str, block_size: int
) -> None:
    """Raises PromptLayoutMismatch, naming the model family and the first differing block, when
    the router's block hashes of the prompt are not vLLM's. No expected hashes: nothing to check
    (a task sent without them)."""
    if not expected:
        return
    if list(expected) == list(actual):
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(expected, actual, strict=False)) if a != b),
        min(len(expected), len(actual)),
    )
    raise PromptLayoutMismatch(
        f"vLLM laid out this {model_type} prompt differently from the router: block {first} of "
        f"{block_size} tokens differs (router {len(expected)} blocks, vLLM {len(actual)}); the "
        f"router's token view for {model_type} does not match vLLM's"
    )
