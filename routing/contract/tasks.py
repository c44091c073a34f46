"""The typed contract between the frontend and the workers: task names, task payloads, stream events.

Pure (no Django, no torch): the web process builds a `GenerateTask` and sends
`task.to_payload()` by the task name; the worker rebuilds it with `GenerateTask.from_payload`,
which refuses a payload of a contract version this worker does not speak
(`UnsupportedContract`). Workers answer on the request's response stream
(`routing.contract.responses`) with `StartedEvent`, `TokenEvent`, then one `DoneEvent` or `ErrorEvent`.
Heartbeats carry `CONTRACT_VERSION`, so the frontend sends only to workers that speak its
version and a rolling upgrade never hands a task to a worker that would misread it.

Extending the contract (media references, tenant salts, encoder embeddings, video, ...):
- a new OPTIONAL field goes at the end of its dataclass with a default that means "absent"
  (None, (), False); it is JSON-safe (str, int, float, bool, None, lists, dicts); the version
  does NOT change: an older worker ignores a field it does not know, and a newer worker reads
  the default from an older frontend's payload;
- a field that a worker must understand to serve the task correctly, a renamed or removed
  field, or a changed meaning is an incompatible change: bump `CONTRACT_VERSION` and list in
  `SUPPORTED_VERSIONS` the versions the worker still reads.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

# The version the frontend writes and the worker prefers; every heartbeat carries it.
# 3: image bytes by reference to the media side store (ImageRef.media_ref);
# 4: the caller's cache partition (GenerateTask.cache_salt);
# 5: penalties, logit bias and log probabilities (GenerateTask, DoneEvent.logprobs);
# 6: continuing a migrated answer (GenerateTask.continued_token_ids, TokenEvent.token_ids).
CONTRACT_VERSION = 6
# Versions this code can read (a worker refuses any other, naming both sides).
SUPPORTED_VERSIONS = frozenset({CONTRACT_VERSION})
VERSION_FIELD = "contract_version"

# Celery task names: the web process sends by name and never imports the worker's code.
GENERATE_TASK = "workers.generate"
FLUSH_CACHES_TASK = "workers.flush_caches"
ENCODE_TASK = "workers.encode"  # E/PD: an encode worker computes a request's image features

# Worker roles (`run_worker --role`): `both` encodes its own images and generates; `llm` generates
# from features an encode worker sends (encoding itself only as a fallback); `encode` holds only
# the vision tower and projector and serves ENCODE_TASK.
ROLE_BOTH, ROLE_LLM, ROLE_ENCODE = "both", "llm", "encode"
ROLES = (ROLE_BOTH, ROLE_LLM, ROLE_ENCODE)
GENERATING_ROLES = frozenset({ROLE_BOTH, ROLE_LLM})

# Stream event types, in the order a worker sends them.
STARTED = "started"  # the worker picked the request up
TOKEN = "token"  # a piece of generated text (the first one ends prefill)
DONE = "done"  # the whole result, with usage and timings
ERROR = "error"  # the request failed on the worker: status, code, message

# ErrorEvent.code of a picture whose size at its origin is no longer the one the request was
# routed with: the frontend forgets the size it kept (routing.media.images.ImageSizes), and the client
# may send the request again.
IMAGE_CHANGED = "image_changed"

# ErrorEvent.code of a request whose worker lost its engine under it (vLLM's engine core died,
# say): the worker is going away, so the frontend takes it as a vanished worker and moves the
# request on (before or after its first token), rather than answer it with the error.
ENGINE_DEAD = "engine_dead"

# ErrorEvent.code of a prompt and completion a worker's KV pool can never hold, as OpenAI names it;
# the frontend answers the same when the workers' announced pools already say so.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def context_length_message(limit: int, prompt_tokens: int, max_tokens: int) -> str:
    """OpenAI's words for a prompt too long, in tokens (never the worker's KV settings): clients
    match on the code, people read the numbers. One text for the frontend and the worker."""
    return (
        f"This model's maximum context length is {limit} tokens. However, you requested "
        f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in the "
        "completion). Please reduce the length of the messages or completion."
    )


class ContractError(ValueError):
    """A payload or event that does not follow the contract (missing or mistyped field)."""

    status = 400
    code = "invalid_task"


class UnsupportedContract(ContractError):
    """A task written in a contract version this process does not speak."""

    status = 503
    code = "unsupported_contract_version"

    def __init__(self, version: object, *, task: str, worker: str = "") -> None:
        self.version = version
        who = f"worker {worker}" if worker else "this worker"
        spoken = ", ".join(str(v) for v in sorted(SUPPORTED_VERSIONS))
        super().__init__(
            f"{who} cannot serve {task}: the task is in contract version {version!r}, "
            f"the worker speaks {spoken}; upgrade the older side"
        )


_SCALARS = frozenset({str, int, float, bool, type(None)})


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def _plain(value: Any) -> Any:
    """`dataclasses.asdict(value)`, equal to it, without copying what cannot change: a tuple of
    strings and numbers (a prompt's block hashes) is the same tuple, where asdict rebuilt it an
    element at a time and deep-copied each (~70 us of a text request's task, ~200 us of one
    with a picture, to be thrown away by json.dumps). Lists and dicts are still copied."""
    cls = type(value)
    if cls in _SCALARS:
        return value
    if cls is tuple:
        if all(type(item) in _SCALARS for item in value):
            return value
        return tuple(_plain(item) for item in value)
    if cls is list:
        return [_plain(item) for item in value]
    if cls is dict:
        return {_plain(key): _plain(item) for key, item in value.items()}
    if dataclasses.is_dataclass(cls):
        return {name: _plain(getattr(value, name)) for name in _field_names(cls)}
    return copy.deepcopy(value)  # as asdict: anything else, a copy of its own


def _from_mapping(cls: type, data: Mapping[str, Any]) -> Any:
    """An instance of dataclass `cls` from `data`: unknown keys ignored, missing required ones refused."""
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    known = {k: v for k, v in data.items() if k in names}
    try:
        return cls(**known)
    except TypeError as exc:  # a required field is missing
        raise ContractError(f"{cls.__name__}: {exc}") from exc


def _checked_payload(payload: Any, task: str, worker: str) -> dict[str, Any]:
    """A task's payload as a dict of its own, once it is an object of a version this side speaks."""
    if not isinstance(payload, Mapping):
        raise ContractError(f"a {task} payload is an object, not {type(payload).__name__}")
    version = payload.get(VERSION_FIELD)
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedContract(version, task=task, worker=worker)
    return dict(payload)


@dataclass(frozen=True)
class ImageRef:
    """One image of a request as the worker receives it."""

    identity: str  # 32-hex identity the frontend computed (URL or pixel identity)
    url: str | None = None
    # The size read from the image's header: the worker lays the prompt out before loading
    # anything and skips loading the images its cached prefix covers.
    width: int | None = None
    height: int | None = None
    # Frontend decoding: the bytes, base64; the worker must not fetch the origin again.
    data_b64: str | None = None
    # Bytes the frontend holds (fetched, or a data URL's), in the media side store
    # (routing.media.store.MediaRef): the worker reads them there once and fetches nothing.
    media_ref: str | None = None
    media_bytes: int = 0


@dataclass(frozen=True)
class VideoRef:
    """One video of a request: always decoded and sampled in the frontend; the worker never fetches it.

    The worker lays the video out from these facts with its own video layout (and refuses a grid
    that disagrees), and reads the sampled frames (RGB uint8, `frame_shape` = frames, height,
    width, 3, already resized for the model) from the media side store by `media_ref`, only when
    its cached prefix does not cover the video.
    """

    identity: str  # 32-hex hash of the sampled, decoded frames
    fps: float
    total_frames: int
    indices: tuple[int, ...]  # the frames kept
    width: int  # of the decoded frames
    height: int
    grid_thw: tuple[int, int, int]
    frame_shape: tuple[int, int, int, int]
    media_ref: str | None = None  # the frames in the side store (routing.media.store)
    media_bytes: int = 0


@dataclass(frozen=True)
class GenerateTask:
    """The payload of `workers.generate`: one chat request for one worker."""

    name: ClassVar[str] = GENERATE_TASK

    request_id: str
    prompt: str  # chat-templated, one placeholder per image
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    images: tuple[ImageRef, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # The keyed hash of the session scope; with session-scoped caches the worker partitions its
    # image and embedding caches by it, and bypasses them for a request without one.
    scope_key: str | None = None
    block_hashes: tuple[int, ...] = ()  # the router's view of the prompt's blocks
    # The frontend processor's encoded model inputs (routing.prompt.processor_view.encode_processed):
    # the worker then skips its own preprocessing.
    processed: dict[str, Any] | None = None
    # The request's videos, in prompt order (a worker that takes no video refuses the prompt).
    videos: tuple[VideoRef, ...] = ()
    # When the frontend sent it (unix seconds, its clock): the worker's queue-time histogram.
    dispatched_at: float | None = None
    # E/PD: the encode worker computing the features of the images at these indices (those the
    # chosen worker's cached prefix does not cover). Their features arrive through the media side
    # store; the worker waits for them at most `encode_wait_s`, then encodes what is missing itself.
    encoder: str | None = None
    encoded_images: tuple[int, ...] = ()
    encode_wait_s: float = 0.0
    # The caller's cache partition (routing.prompt.hashing.cache_salt, 16 hex digits; None: the shared
    # pool): the worker folds it into the first block's hash, as the router did, and partitions
    # its image and embedding caches by it. A worker that ignored it would share one tenant's
    # cache with another: hence contract version 4.
    cache_salt: str | None = None
    # The frontend's request id (the task's own id changes when the request migrates): the key of
    # the frontend's liveness mark (routing.contract.responses.live_key) and of the request's load entry.
    # The worker drops the request once the mark expires (its frontend died) and frees that load.
    # None (an older frontend): no liveness check.
    follow_id: str | None = None
    # Sampling beyond temperature and top_p (workers.sampler); a worker that ignored them would
    # answer differently from what was asked: hence contract version 5.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None  # token id (a JSON key, so a string) -> bias
    logprobs: bool = False
    top_logprobs: int = 0
    # A migration mid-answer: the tokens the client already has from a worker that vanished.
    # The worker appends them to the prompt and continues after them (`max_tokens` is what is
    # left of the budget); a worker that ignored them would repeat the answer from its start:
    # hence contract version 6.
    continued_token_ids: tuple[int, ...] = ()
    # The router's count of the prompt's tokens (images expanded), and where each image's
    # placeholder run ends in it, in image order: an engine without a tokenizer (the simulated
    # one, workers.sim_engine) sizes its prefill and knows which images its cached prefix covers
    # from them. 0 and (): not sent (an older frontend); engines that lay the prompt out
    # themselves ignore them, hence no new version.
    prompt_tokens: int = 0
    image_ends: tuple[int, ...] = ()
    # The request's priority (routing.admission: 0 to MAX_PRIORITY, higher first; None: not said).
    # The engine's scheduler computes the waiting prompts of a higher priority first; a worker
    # that ignores it still answers correctly, only in its own order: no version change.
    priority: int | None = None
    # Add optional fields here, with defaults (see the module docstring).

    def to_payload(self) -> dict[str, Any]:
        payload = _plain(self)
        payload[VERSION_FIELD] = CONTRACT_VERSION
        return payload

    @property
    def token_bias(self) -> dict[int, float]:
        return {int(token): float(bias) for token, bias in (self.logit_bias or {}).items()}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], *, worker: str = "") -> GenerateTask:
        """The task from its JSON payload; `UnsupportedContract` for another version."""
        data = _checked_payload(payload, cls.name, worker)
        try:
            data["images"] = tuple(_from_mapping(ImageRef, image) for image in data.get("images") or ())
            data["videos"] = tuple(_video_ref(video) for video in data.get("videos") or ())
            data["stop"] = tuple(str(s) for s in data.get("stop") or ())
            data["block_hashes"] = tuple(int(h) for h in data.get("block_hashes") or ())
            data["encoded_images"] = tuple(int(i) for i in data.get("encoded_images") or ())
            data["continued_token_ids"] = tuple(int(t) for t in data.get("continued_token_ids") or ())
            data["image_ends"] = tuple(int(end) for end in data.get("image_ends") or ())
            task = _from_mapping(cls, data)
            return dataclasses.replace(
                task,
                max_tokens=int(task.max_tokens),
                temperature=float(task.temperature),
                top_p=float(task.top_p),
                seed=None if task.seed is None else int(task.seed),
                prompt_tokens=int(task.prompt_tokens),
            )
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ContractError):
                raise
            raise ContractError(f"{cls.name}: a field has the wrong type: {exc}") from exc


def _video_ref(data: Mapping[str, Any]) -> VideoRef:
    video = _from_mapping(VideoRef, data)
    return dataclasses.replace(
        video,
        fps=float(video.fps),
        total_frames=int(video.total_frames),
        indices=tuple(int(i) for i in video.indices),
        width=int(video.width),
        height=int(video.height),
        grid_thw=tuple(int(n) for n in video.grid_thw),
        frame_shape=tuple(int(n) for n in video.frame_shape),
    )


@dataclass(frozen=True)
class EncodeTask:
    """The payload of `workers.encode`: some of one request's images for an encode worker, which
    puts each image's features in the media side store and signals the LLM worker
    (routing.fleet.encoders) with the reference, or with why it could not."""

    name: ClassVar[str] = ENCODE_TASK

    request_id: str
    images: tuple[ImageRef, ...]
    indices: tuple[int, ...]  # each image's index in the request (what the LLM worker waits on)
    scope_key: str | None = None
    llm_worker: str = ""  # for the logs
    # The caller's cache partition, as in GenerateTask: the encode worker's embedding cache is
    # partitioned by it exactly as the LLM worker's is.
    cache_salt: str | None = None
    # The frontend's request id (the task's own id changes when the request migrates): the key of
    # the frontend's liveness mark (routing.contract.responses.live_key) and of the request's load entry.
    # The worker drops the request once the mark expires (its frontend died) and frees that load.
    # None (an older frontend): no liveness check.
    follow_id: str | None = None
    # Add optional fields here, with defaults (see the module docstring).

    def to_payload(self) -> dict[str, Any]:
        payload = _plain(self)
        payload[VERSION_FIELD] = CONTRACT_VERSION
        return payload

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], *, worker: str = "") -> EncodeTask:
        data = _checked_payload(payload, cls.name, worker)
        try:
            data["images"] = tuple(_from_mapping(ImageRef, image) for image in data.get("images") or ())
            data["indices"] = tuple(int(i) for i in data.get("indices") or ())
        except (TypeError, ValueError, AttributeError) as exc:
            if isinstance(exc, ContractError):
                raise
            raise ContractError(f"{cls.name}: a field has the wrong type: {exc}") from exc
        task = _from_mapping(cls, data)
        if len(task.indices) != len(task.images):
            raise ContractError(f"{cls.name}: {len(task.images)} images but {len(task.indices)} indices")
        return task


@dataclass(frozen=True)
class FlushCachesTask:
    """The payload of `workers.flush_caches`: drop caches, or one session scope's entries."""

    name: ClassVar[str] = FLUSH_CACHES_TASK

    flush_id: str  # the response stream the worker answers on
    scope_key: str | None = None
    dry_run: bool = False
    kv: bool = False
    embeddings: bool = False
    images: bool = False
    # The shared image cache, flushed by the worker through its own configuration (the command's
    # environment may not have it); the answer's `shared_images` is a count, or "off".
    shared_images: bool = False

    def to_payload(self) -> dict[str, Any]:
        payload = _plain(self)
        payload[VERSION_FIELD] = CONTRACT_VERSION
        return payload

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any], *, worker: str = "") -> FlushCachesTask:
        return _from_mapping(cls, _checked_payload(payload, cls.name, worker))


# --- stream events ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class StartedEvent:
    type: ClassVar[str] = STARTED
    worker: str = ""
    instance: str = ""  # the worker process's instance id (routing.fleet.registry)


@dataclass(frozen=True)
class TokenEvent:
    type: ClassVar[str] = TOKEN
    text: str = ""
    # With `logprobs`: the entries ({token, logprob, bytes, top_logprobs}) of the tokens this piece
    # completes, so a streamed chunk carries its own tokens' log probabilities as OpenAI's do. Any
    # token no piece carried (a stop string's) is only in DoneEvent.logprobs, which lists them all.
    logprobs: list[dict[str, Any]] | None = None
    # The ids of the tokens this piece completes (contract 6), so that a frontend can continue
    # the answer on another worker from exactly what the client has; None from an older worker.
    token_ids: list[int] | None = None


@dataclass(frozen=True)
class DoneEvent:
    type: ClassVar[str] = DONE
    text: str = ""
    finish_reason: str = "stop"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    total_ms: float = 0.0
    encoder_calls: int = 0
    embedding_cache_hits: int = 0
    embedding_cache_misses: int = 0
    worker: str = ""
    embeddings_received: int = 0  # E/PD: images whose features came from an encode worker
    embedding_fallbacks: int = 0  # E/PD: images sent for encoding that this worker encoded itself
    # With `logprobs`: per completion token {token, logprob, bytes, top_logprobs}, OpenAI's shape.
    logprobs: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class ErrorEvent:
    type: ClassVar[str] = ERROR
    status: int = 502
    code: str = "worker_error"
    message: str = "The worker failed."
    param: str | None = None
    # A refused image's place among the request's images: the frontend names its message part.
    image_index: int | None = None


StreamEvent = StartedEvent | TokenEvent | DoneEvent | ErrorEvent
_EVENT_CLASSES: dict[str, type] = {cls.type: cls for cls in (StartedEvent, TokenEvent, DoneEvent, ErrorEvent)}
# Each event's field names: its fields hold JSON values, no dataclass, so a shallow read is the
# whole of it (asdict's deep copy cost a token's path ~4 us, to be thrown away by json.dumps).
_EVENT_FIELDS: dict[type, tuple[str, ...]] = {
    cls: tuple(field.name for field in dataclasses.fields(cls)) for cls in _EVENT_CLASSES.values()
}


def event_data(event: StreamEvent) -> dict[str, Any]:
    """The event's fields as the JSON object a response stream entry carries."""
    return {name: getattr(event, name) for name in _EVENT_FIELDS[type(event)]}


def parse_event(event_type: str, data: Mapping[str, Any]) -> StreamEvent | None:
    """The typed event of a stream entry; None for a type this contract does not know."""
    cls = _EVENT_CLASSES.get(event_type)
    if cls is None:
        return None
    return _from_mapping(cls, data)
