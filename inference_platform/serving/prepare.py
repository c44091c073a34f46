"""A validated chat request as the router sees it: prompt, images, token view, and the decision.

`prepare` is synchronous and pure of I/O beyond fetching image headers (it runs in a thread);
a served request (`served.ServedRequest`), the `/v1/route` endpoint and `manage.py
inspect_request` all see a request through it. `areserve_worker` decides and reserves;
`preview_worker` decides without reserving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.conf import settings

from inference_platform.serving.chat import ChatRequest, ImagePart, VideoPart
from inference_platform.serving.dispatch import (
    EligibleWorkers,
    lease_ttl_s,
    worker_states,
)
from inference_platform.serving.encoding import describe_encoding
from inference_platform.serving.errors import ApiError
from inference_platform.serving.frontend import frontend
from inference_platform.serving.model_pool import deployment_model_name
from routing.contract.tasks import (
    CONTEXT_LENGTH_EXCEEDED,
    GenerateTask,
    ImageRef,
    VideoRef,
    context_length_message,
)
from routing.fleet.registry import Heartbeat
from routing.kv.decision import AllWorkersBusy, RoutingDecision
from routing.kv.lease import RequestLease
from routing.kv.selection import Score
from routing.media.images import (
    ImageSizes,
    MediaError,
    MediaPolicy,
    ResolvedImage,
    decode_image,
    resolve_images,
    routing_hash,
    url_identity,
)
from routing.media.store import MediaRef
from routing.media.video import SampledVideo, VideoLimits, resolve_videos
from routing.policy import DEPLOYMENT_POLICY, LivePolicy, ModelPolicy
from routing.prompt.layouts import FAMILY_NAMES, ImageSizeRefused, LayoutConfigError
from routing.prompt.model_view import ModelDirectoryError, ModelView, model_view
from routing.prompt.session_scope import SessionScopeError, resolve_session_scope, scope_hash
from routing.prompt.token_view import PlaceholderMismatch, TokenView, VideoFacts, build_token_view
from routing.prompt.video_layouts import video_expansion_ids
from tenants.keys import ANONYMOUS, Caller

logger = logging.getLogger("inference_platform.serving")


def served_model() -> ModelView:
    """The deployment's own model (MODEL_PATH): the default a client's request names."""
    return model_view(settings.MODEL_PATH, deployment_model_name())


def check_served_model() -> None:
    """Refuse to start on image settings the model's own processor refuses (a clear message, once).

    A missing model directory is left to the requests (503), as before: only settings that are
    there and wrong stop the start-up, since every image request would be counted wrongly.
    """
    from django.core.exceptions import ImproperlyConfigured

    model = served_model()
    if not (model.path / "config.json").is_file():
        return
    try:
        layout = model.image_layout
        model.image_token_ids  # noqa: B018 - the tokenizer must hold the layout's marker tokens
    except (LayoutConfigError, ModelDirectoryError) as exc:
        raise ImproperlyConfigured(f"the served model at {model.path} cannot be routed: {exc}") from exc
    if layout is not None and model.image_placeholder_id is None:
        raise ImproperlyConfigured(
            f"the served model at {model.path} cannot be routed: its tokenizer has no "
            f"{layout.placeholder_token!r} token, which its chat template marks images with"
        )
    if layout is None:
        logger.info(
            "model type %r has no image layout: image requests route on the text prefix", model.model_type
        )


def session_scope_hash(headers: Mapping[str, str], caller: Caller = ANONYMOUS) -> str | None:
    """The keyed hash of the request's session scope, or None without one.

    The one place a scope is read: raw scope ids are secrets and go no further than this. The
    hash binds the scope to the caller's tenant: a scope id another tenant learns (or guesses)
    names a different partition there.
    """
    try:
        scope = resolve_session_scope(headers)
    except SessionScopeError as exc:
        raise ApiError(400, str(exc), code="invalid_session_scope", param=exc.header) from exc
    if scope is None:
        return None
    return scope_hash(scope, settings.SECRET_KEY.encode(), bind_to=caller.scope_binding)


def media_policy() -> MediaPolicy:
    return MediaPolicy(
        max_bytes=int(settings.DYN_MM_MAX_FILE_SIZE_MB * 1024 * 1024),
        connect_timeout=settings.MEDIA_CONNECT_TIMEOUT_SECS,
        read_timeout=settings.MEDIA_READ_TIMEOUT_SECS,
        deadline=settings.MEDIA_FETCH_DEADLINE_SECS,
        allowed_hosts=tuple(settings.MEDIA_ALLOWED_HOSTS),
        max_pixels=settings.MEDIA_MAX_PIXELS,
    )


def video_limits() -> VideoLimits:
    return VideoLimits(
        max_duration_s=settings.VIDEO_MAX_DURATION_SECS,
        max_frames=settings.VIDEO_MAX_FRAMES,
        max_pixels_per_frame=settings.VIDEO_MAX_PIXELS_PER_FRAME,
        max_total_pixels=settings.VIDEO_MAX_TOTAL_PIXELS,
        deadline_s=settings.VIDEO_DECODE_DEADLINE_SECS,
        decode_cache_bytes=int(settings.VIDEO_DECODE_CACHE_MB * 1024 * 1024),
    )


@dataclass
class PreparedRequest:
    """A request as the router sees it, before any worker is chosen."""

    chat: ChatRequest
    model: ModelView
    prompt: str
    images: list[ResolvedImage]
    view: TokenView
    frontend_decoding: bool
    processed: dict[str, Any] | None = None  # the processor path's model inputs, for the worker
    videos: list[SampledVideo] = dataclasses.field(default_factory=list)  # always frontend-decoded
    # The model's fingerprint (routing.prompt.model_card): what its workers must announce, and
    # the KV partition the view's block hashes fold in.
    fingerprint: str = ""
    policy: ModelPolicy = DEPLOYMENT_POLICY  # the model's own routing fields over the deployment's

    def describe(self) -> dict[str, Any]:
        """What `/v1/route` and `inspect_request` print: the request in the router's eyes."""
        count_source = self.view.count_source
        if count_source is None and self.view.fallback:
            count_source = "none: routed on the text prefix"
        return {
            "model": self.model.name,
            "model_type": self.model.model_type,
            # The support-matrix family the image counts follow (None: a family outside it).
            "family": FAMILY_NAMES.get(self.model.model_type),
            "count_source": count_source,
            "prompt_tokens": self.view.prompt_tokens,
            "routed_tokens": len(self.view.tokens),
            "block_size": self.view.block_size,
            "total_blocks": self.view.total_blocks,
            "block_hashes": self.view.block_hashes,
            "fallback": self.view.fallback,
            "frontend_decoding": self.frontend_decoding,
            "chat_processor": "transformers" if self.processed is not None else "registry",
            "images": [
                {
                    "index": image.index,
                    "identity": image.identity,
                    "routing_hash": image.routing_hash,
                    "width": image.width,
                    "height": image.height,
                    "tokens": image.tokens,
                    "start": image.start,
                    "count_source": count_source,
                }
                for image in self.view.images
            ],
            "videos": [
                {
                    "index": video.index,
                    "identity": video.identity,
                    "routing_hash": video.routing_hash,
                    "width": sampled.width,
                    "height": sampled.height,
                    "fps": sampled.fps,
                    "total_frames": sampled.total_frames,
                    "frames_kept": video.frames,
                    "frame_indices": list(sampled.indices),
                    "grid_thw": list(sampled.expansion.grid_thw),
                    "tokens": video.tokens,
                    "start": video.start,
                    # Blocks the video's run touches, and those it fills wholly.
                    "blocks": _blocks_touched(video.start, video.tokens, self.view.block_size),
                    "full_blocks": _blocks_covered(video.start, video.tokens, self.view.block_size),
                    "decode_ms": round(sampled.decode_ms, 3),
                }
                for video, sampled in zip(self.view.videos, self.videos, strict=True)
            ],
        }

    def generate_task(
        self,
        request_id: str,
        scope_key: str | None,
        media: Mapping[int, MediaRef] | None = None,
        video_media: Mapping[int, MediaRef] | None = None,
    ) -> GenerateTask:
        """The worker's task for this request (routing.contract.tasks); `media` maps an image's index
        to its bytes in the side store (routing.media.store), `video_media` a video's to its frames."""
        media = media or {}
        video_media = video_media or {}
        images = tuple(
            ImageRef(
                identity=resolved.identity,
                # Bytes held here travel by reference: the worker must not fetch the origin again.
                url=None if resolved.index in media else resolved.url,
                width=resolved.width,
                height=resolved.height,
                **(media[resolved.index].to_payload() if resolved.index in media else {}),
            )
            for resolved in self.images
        )
        return GenerateTask(
            request_id=request_id,
            prompt=self.prompt,
            images=images,
            max_tokens=self.chat.max_tokens,
            temperature=self.chat.temperature,
            top_p=self.chat.top_p,
            seed=self.chat.seed,
            stop=tuple(self.chat.stop or ()),
            scope_key=scope_key,
            block_hashes=tuple(self.view.block_hashes),
            processed=self.processed,
            videos=tuple(
                VideoRef(
                    identity=video.identity,
                    fps=video.fps,
                    total_frames=video.total_frames,
                    indices=video.indices,
                    width=video.width,
                    height=video.height,
                    grid_thw=video.expansion.grid_thw,
                    frame_shape=video.frame_shape,
                    # The frames wait in the side store; the task carries only where.
                    **(video_media[video.index].to_payload() if video.index in video_media else {}),
                )
                for video in self.videos
            ),
            # The caller's cache partition, folded into the first block's hash here and there.
            cache_salt=None if self.view.cache_salt is None else f"{self.view.cache_salt:016x}",
            presence_penalty=self.chat.presence_penalty,
            frequency_penalty=self.chat.frequency_penalty,
            logit_bias={str(token): bias for token, bias in self.chat.logit_bias.items()} or None,
            logprobs=self.chat.logprobs,
            top_logprobs=self.chat.top_logprobs,
            prompt_tokens=self.view.prompt_tokens,
            image_ends=tuple(image.start + image.tokens for image in self.view.images),
        )


def image_size_scope(cache_salt: int | None, scope_key: str | None) -> tuple[int | None, str | None]:
    """Whose kept image sizes a request may use: its caller's cache partition and, where image
    caches are session-scoped (the origin may answer each session with other content), its
    session's (a keyed hash, never the raw id)."""
    return cache_salt, scope_key if settings.DYN_MM_IMAGE_CACHE_SESSION_SCOPED else None


def prepare(
    chat: ChatRequest,
    cache_salt: int | None = None,
    *,
    sizes: ImageSizes | None = None,
    scope_key: str | None = None,
) -> PreparedRequest:
    """Render the prompt, resolve the images (identity, size), and build the routing token view.

    `cache_salt` is the caller's cache partition (tenants.keys.Caller.cache_salt): it folds
    into the view's block hashes, and the worker folds the same salt into its own. With `sizes`,
    an image whose size was read lately in the same scope (`image_size_scope`) is not asked of
    its origin again.
    """
    if sizes is not None:
        sizes.follow_flushes()
    served = frontend().models().resolve(chat.model)  # before any work: an unknown model is a 404
    prepared = _prepare(chat, served.view, sizes, image_size_scope(cache_salt, scope_key))
    view = prepared.view.of_model(served.fingerprint).salted(cache_salt)
    return dataclasses.replace(prepared, view=view, fingerprint=served.fingerprint, policy=served.policy)


def _prepare(
    chat: ChatRequest, model: ModelView, sizes: ImageSizes | None, size_scope: tuple
) -> PreparedRequest:
    if chat.logit_bias:
        _check_logit_bias(model, chat.logit_bias)
    try:
        # Control tokens a client wrote stay text: only the template makes roles and placeholders.
        prompt = model.render_prompt(model.literal_messages(chat.messages))
        prompt_ids = model.encode(prompt)
    except ModelDirectoryError as exc:
        raise ApiError(503, f"The model is not available: {exc}", code="model_unavailable") from exc
    except Exception as exc:  # the template refused these messages (e.g. roles out of order)
        raise ApiError(
            400, f"The model's chat template refused these messages: {exc}", code="invalid_messages"
        ) from exc

    frontend_decoding = frontend().policy().frontend_decoding
    videos = _resolve_videos(model, chat)
    # The processor path takes no video here: a request with one uses the layout registry.
    use_processor = settings.DYN_CHAT_PROCESSOR == "transformers" and bool(chat.images) and not videos
    urls = [part.url for part in chat.images]
    try:
        # The processor needs the pixels, so that path fetches every image in full here.
        images = resolve_images(
            urls,
            media_policy(),
            frontend_decoding=frontend_decoding or use_processor,
            sizes=sizes,
            scope=size_scope,
            decoded=frontend().decoded_data_urls(),
        )
    except MediaError as exc:
        # An origin that fails or times out is still a problem with the request's image: a 4xx
        # naming it, never a 5xx that would blame the platform.
        raise media_refused(exc, chat.images) from exc
    if use_processor:
        if not frontend_decoding:  # the identity stays the URL's, as on the default path
            images = [
                dataclasses.replace(
                    i, identity=url_identity(i.url), routing_hash=routing_hash(url_identity(i.url))
                )
                for i in images
            ]
        processed = _processor_view(model, prompt, images)
        if processed is not None:
            view, inputs = processed
            return PreparedRequest(chat, model, prompt, images, view, frontend_decoding, processed=inputs)
    try:
        layout = model.image_layout
        view = build_token_view(
            prompt_ids,
            images,
            layout=layout,
            placeholder_id=model.image_placeholder_id,
            block_size=settings.KV_BLOCK_SIZE,
            model_type=model.model_type,
            text_prefix=_text_before_first_image(model, chat, prompt_ids) if layout is None else None,
            videos=[_video_facts(model, video) for video in videos],
            video_placeholder_id=model.video_placeholder_id,
            token_ids=model.image_token_ids,
        )
    except (LayoutConfigError, ModelDirectoryError) as exc:
        # Refused at start-up too (check_served_model); a model swapped in later lands here.
        raise ApiError(503, f"The model is not available: {exc}", code="model_unavailable") from exc
    except ImageSizeRefused as exc:
        raise ApiError(422, f"{exc}", code="image_size_refused", param="messages") from exc
    except PlaceholderMismatch as exc:
        raise ApiError(
            400, f"The chat template and the images disagree: {exc}", code="invalid_messages"
        ) from exc
    if view.fallback:
        logger.info("routing on the text prefix: %s", view.fallback)
    return PreparedRequest(chat, model, prompt, images, view, frontend_decoding, videos=videos)


def _resolve_videos(model: ModelView, chat: ChatRequest) -> list[SampledVideo]:
    """Each video fetched, decoded, sampled and hashed here (always: exact video routing needs
    the frontend to decode, whatever DYN_MM_FRONTEND_DECODING says for images)."""
    if not chat.videos:
        return []
    try:
        return resolve_videos(
            [part.url for part in chat.videos], media_policy(), model.video_layout, video_limits()
        )
    except MediaError as exc:
        raise media_refused(exc, chat.videos) from exc


def media_refused(exc: MediaError, parts: Sequence[ImagePart | VideoPart]) -> ApiError:
    """A refused image or video as the API answers it: a 4xx (an origin that fails is still the
    request's problem), its `param` the message part that names it when the error says which."""
    index = exc.image_index
    param = parts[index].param if index is not None and 0 <= index < len(parts) else "messages"
    return ApiError(400 if exc.status >= 500 else exc.status, exc.message, code=exc.code, param=param)


def _video_facts(model: ModelView, video: SampledVideo) -> VideoFacts:
    expansion_ids = video_expansion_ids(
        video.expansion,
        model.encode,
        placeholder_id=model.video_placeholder_id,
        vision_start_id=model.token_id("<|vision_start|>"),
        vision_end_id=model.token_id("<|vision_end|>"),
    )
    return VideoFacts(video.identity, video.routing_hash, len(video.indices), expansion_ids)


def _blocks_touched(start: int, length: int, block_size: int) -> int:
    return (start + length - 1) // block_size - start // block_size + 1 if length else 0


def _blocks_covered(start: int, length: int, block_size: int) -> int:
    first = -(-start // block_size)
    return max(0, (start + length) // block_size - first)


def _check_logit_bias(model: ModelView, logit_bias: Mapping[int, float]) -> None:
    try:
        vocabulary = model.tokenizer.get_vocab_size(with_added_tokens=True)
    except ModelDirectoryError as exc:
        raise ApiError(503, f"The model is not available: {exc}", code="model_unavailable") from exc
    outside = sorted(token for token in logit_bias if token >= vocabulary)
    if outside:
        raise ApiError(
            400,
            f"'logit_bias' names token {outside[0]}, outside the model's vocabulary of {vocabulary} tokens.",
            code="invalid_value",
            param="logit_bias",
        )


def _decision_inputs(
    prepared: PreparedRequest,
    workers: Mapping[str, Heartbeat],
    scope_key: str | None,
    live: LivePolicy | None = None,
):
    view = prepared.view
    policy = prepared.policy.over(live or frontend().policy())
    # What the fleet read already worked out of these workers, or the same from a plain mapping.
    eligible = workers if isinstance(workers, EligibleWorkers) else EligibleWorkers(workers)
    args = (view.block_hashes, view.prompt_tokens, view.block_size, eligible.names, policy.routing)
    options = {
        "session_key": scope_key,
        "affinity_enabled": policy.session_affinity,
        "approximate_workers": eligible.approximate,
        "reports": eligible.reports,
        "mode": policy.mode,
    }
    return args, options, eligible


def preview_worker(
    prepared: PreparedRequest, workers: Mapping[str, Heartbeat], scope_key: str | None
) -> RoutingDecision:
    """The decision the router would make now, reserving nothing (`/v1/route`, inspect_request)."""
    args, options, _ = _decision_inputs(prepared, workers, scope_key)
    return frontend().router().route(*args, **options)


async def areserve_worker(
    prepared: PreparedRequest,
    workers: Mapping[str, Heartbeat],
    scope_key: str | None,
    request_id: str,
    *,
    conditional: bool = True,
    unless_waiting: str | None = None,
) -> RequestLease:
    """Decide and reserve in one atomic step (the baselines, round robin and random, too), on the
    running event loop (KvRouter.adecide): no thread to hand the round trip to and back.

    Workers from a fleet read (`EligibleWorkers`) are decided over only while the rows'
    generation is still the read's (`conditional`): StaleWorkers, nothing reserved, when it moved.
    `unless_waiting`: the admission queue's key of the model (`AdmissionQueue.waiting_key`), for
    a decision made only while no request waits there: RequestsWaiting, nothing reserved, else.
    """
    front = frontend()
    args, options, eligible = _decision_inputs(prepared, workers, scope_key, await front.apolicy())
    return await front.router().adecide(
        front.redis_lines(),
        request_id,
        *args,
        instances=eligible.instances,
        reservation_ttl_s=lease_ttl_s(),
        only_if=eligible.rows_generation if conditional else None,
        unless_waiting=unless_waiting,
        scores=False,  # a request being dispatched reads the chosen worker's alone
        **options,
    )


def context_length_exceeded(limit: int, prompt_tokens: int, max_tokens: int) -> ApiError:
    """OpenAI's answer to a prompt too long, in the worker's own words (routing.contract.tasks)."""
    return ApiError(
        400,
        context_length_message(limit, prompt_tokens, max_tokens),
        code=CONTEXT_LENGTH_EXCEEDED,
        param="messages",
    )


def check_context_length(
    prompt_tokens: int, max_tokens: int, workers: Mapping[str, Heartbeat], block_size: int
) -> None:
    """Refuse here a request no eligible worker could ever run: its prompt and completion must fit
    one worker's KV pool (what each worker announces), as the worker itself would check after a
    trip through the queue. Workers that announce no capacity are left to refuse it themselves."""
    capacities = [beat.kv_capacity_blocks for beat in workers.values() if beat.kv_capacity_blocks > 0]
    if not capacities or len(capacities) < len(workers):
        return
    limit = max(capacities) * block_size
    if prompt_tokens + max_tokens > limit:
        raise context_length_exceeded(limit, prompt_tokens, max_tokens)


def all_busy(model: str, request_id: str, busy: AllWorkersBusy) -> ApiError:
    retry_after = settings.ROUTER_BUSY_RETRY_AFTER_SECS
    return ApiError(
        503,
        f"Every worker serving '{model}' is busy ({len(busy.workers)} past the busy threshold); "
        f"retry request {request_id} in {retry_after:g} s.",
        code="all_workers_busy",
        headers={"Retry-After": str(max(1, math.ceil(retry_after)))},
    )


_IMAGE_SENTINEL = "\u2063IMAGE\u2063"  # invisible separators: no real prompt holds this


def _text_before_first_image(model: ModelView, chat: ChatRequest, prompt_ids: list[int]) -> int | None:
    """How many prompt tokens surely precede the first image, for routing on the text alone.

    The template is rendered again with each image replaced by a sentinel text; the tokens of
    what precedes the sentinel, as far as they agree with the real prompt's, are the prefix.
    """
    if not chat.images:
        return None
    messages = [
        {
            **message,
            "content": [
                {"type": "text", "text": _IMAGE_SENTINEL} if part.get("type") == "image" else part
                for part in message["content"]
            ]
            if isinstance(message["content"], list)
            else message["content"],
        }
        for message in model.literal_messages(chat.messages)
    ]
    before, found, _ = model.render_prompt(messages).partition(_IMAGE_SENTINEL)
    if not found:
        return 0
    prefix_ids = model.encode(before)
    agreed = 0
    for mine, real in zip(prefix_ids, prompt_ids, strict=False):
        if mine != real:
            break
        agreed += 1
    return agreed


def _processor_view(
    model: ModelView, prompt: str, images: list[ResolvedImage]
) -> tuple[TokenView, dict] | None:
    """The token view from the model's own processor; None (text-prefix routing) if it can't say."""
    from routing.prompt.processor_view import UnsupportedProcessorLayout, processor_token_view

    policy = media_policy()
    pixels = [decode_image(image.data, policy) for image in images if image.data is not None]
    try:
        result = processor_token_view(model.path, prompt, pixels, images, block_size=settings.KV_BLOCK_SIZE)
    except UnsupportedProcessorLayout as exc:
        logger.info("the processor path cannot place these images (%s): routing on the text prefix", exc)
        return None
    except ValueError as exc:  # the processor refused the images (sizes, counts)
        raise ApiError(422, f"The model's processor refused the images: {exc}", code="image_refused") from exc
    return result.view, result.processed


async def describe_route(
    chat: ChatRequest, headers: Mapping[str, str], caller: Caller = ANONYMOUS
) -> dict[str, Any]:
    """`/v1/route`: the request in the router's eyes, and the live workers it would choose among.

    Computed in the caller's own cache partition: it shows what this caller's request would
    reuse, never another tenant's prefixes.
    """
    # A malformed scope is refused here as in a real request; the scope partitions E/PD's affinity.
    scope_key = session_scope_hash(headers, caller)
    prepared = await asyncio.to_thread(
        prepare, chat, caller.cache_salt(chat.cache_salt), sizes=frontend().image_sizes(), scope_key=scope_key
    )
    return prepared.describe() | await describe_workers(prepared, scope_key)


async def describe_workers(prepared: PreparedRequest, scope_key: str | None) -> dict[str, Any]:
    """The workers' side of `/v1/route` (and `inspect_request`): the choice the router would make
    now, the E/PD plan, and every worker of the model with its overlap, load terms and cost, as
    the router computes them (nothing reserved)."""
    description: dict[str, Any] = {}
    states = await worker_states(
        prepared.model.name, prepared.view.block_size, fingerprint=prepared.fingerprint
    )
    workers = {state.name: state.heartbeat for state in states if state.ineligible_because is None}
    scores: dict[str, Score] = {}
    busy: tuple[str, ...] = ()
    decision = None
    if workers:
        try:
            decision = await asyncio.to_thread(preview_worker, prepared, workers, None)
        except AllWorkersBusy as exc:
            busy = exc.workers
            description["choice"] = None
    if decision is not None:
        scores = {score.worker: score for score in decision.scores}
        busy = decision.busy
        description["choice"] = {
            "worker": decision.worker,
            "overlap": decision.overlap,
            "best_overlap": decision.best_overlap,
            "reason": decision.reason,
        }
    choice = description.get("choice") or {}
    description["encode"] = await describe_encoding(
        prepared.generate_task("route", scope_key),
        prepared.view,
        prepared.model.name,
        choice.get("worker"),
        choice.get("overlap", 0),
    )
    description["candidates"] = [
        {
            "worker": state.name,
            "eligible": state.ineligible_because is None,
            "ineligible_because": state.ineligible_because,
            "busy": state.name in busy,
            **(
                {
                    "overlap": scores[state.name].overlap,
                    "prefill_blocks": scores[state.name].prefill_blocks,
                    "decode_blocks": scores[state.name].decode_blocks,
                    "cost": scores[state.name].cost,
                }
                if state.name in scores
                else {}
            ),
        }
        for state in states
    ]
    return description
