"""Validation of an OpenAI chat completion request body, once, at the edge.

Every problem becomes an ApiError naming the offending field (`param`), so clients see what
to fix; nothing past this module has to re-check shapes.
"""

from __future__ import annotations

import json
import math
from typing import Any

from inference_platform.api.errors import ApiError
from inference_platform.serving.chat import ChatRequest, ImagePart, VideoPart

ROLES = {"system", "user", "assistant", "developer", "tool"}
MAX_STOP_SEQUENCES = 4
# Far deeper than any chat request needs, far shallower than the parser's recursion limit.
MAX_JSON_DEPTH = 400
MAX_CACHE_SALT_LENGTH = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300

# Fields OpenAI defines that this platform cannot honour: refused by name rather than silently
# ignored (a caller relying on them must know). Unknown fields stay ignored, as OpenAI does.
UNSUPPORTED_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls", "audio")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object; 400 for anything else, nesting past MAX_JSON_DEPTH included."""
    try:
        body = json.loads(raw or b"")
        too_deep = json_depth_exceeds(body, MAX_JSON_DEPTH)
    except RecursionError:  # nested deeper than the parser's own stack allows
        too_deep = True
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if too_deep:
        raise ApiError(
            400, f"The request body nests deeper than {MAX_JSON_DEPTH} levels.", code="invalid_json"
        )
    if not isinstance(body, dict):
        raise ApiError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


def json_depth_exceeds(value: Any, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than `limit` (iterative: no recursion to overflow)."""
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, dict | list) else []
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="invalid_value", param=param)


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, *, low_open=False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(name, f"'{name}' must be a number.")
    if not math.isfinite(value):  # JSON's NaN and Infinity parse; NaN compares false to any bound
        raise _invalid(name, f"'{name}' must be a finite number; got {value}.")
    if value > high or value < low or (low_open and value == low):
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise _invalid(name, f"'{name}' must be {bound} and at most {high}; got {value}.")
    return float(value)


def _content(
    message_index: int, content: Any, images: list[ImagePart], videos: list[VideoPart]
) -> str | list[dict[str, Any]]:
    param = f"messages[{message_index}].content"
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(param, f"'{param}' must be a string or a list of content parts.")
    parts: list[dict[str, Any]] = []
    for part_index, part in enumerate(content):
        part_param = f"{param}[{part_index}]"
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _invalid(part_param, f"'{part_param}' must be an object with a 'type'.")
        kind = part["type"]
        if kind == "text":
            if not isinstance(part.get("text"), str):
                raise _invalid(f"{part_param}.text", f"'{part_param}.text' must be a string.")
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            image = part.get("image_url")
            if isinstance(image, str):
                image = {"url": image}
            if not isinstance(image, dict) or not isinstance(image.get("url"), str) or not image["url"]:
                raise _invalid(
                    f"{part_param}.image_url", f"'{part_param}.image_url.url' must be a non-empty string."
                )
            detail = image.get("detail")
            if detail is not None and detail not in ("auto", "low", "high"):
                raise _invalid(f"{part_param}.image_url.detail", "'detail' must be one of auto, low, high.")
            images.append(ImagePart(index=len(images), url=image["url"], detail=detail))
            # transformers' chat templates know images as {"type": "image"}; Qwen's also
            # accepts OpenAI's image_url form, most others (Gemma, LLaVA) do not.
            parts.append({"type": "image", "url": image["url"]})
        elif kind == "video_url":  # as vLLM and Dynamo take it
            video = part.get("video_url")
            if isinstance(video, str):
                video = {"url": video}
            if not isinstance(video, dict) or not isinstance(video.get("url"), str) or not video["url"]:
                raise _invalid(
                    f"{part_param}.video_url", f"'{part_param}.video_url.url' must be a non-empty string."
                )
            videos.append(VideoPart(index=len(videos), url=video["url"]))
            # transformers' chat templates know videos as {"type": "video"}.
            parts.append({"type": "video", "url": video["url"]})
        else:
            raise ApiError(
                400,
                f"Content part type '{kind}' is not supported here.",
                code="unsupported_content",
                param=part_param,
            )
    return parts


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_parameter", param=param)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_FIELDS:
        if body.get(name) not in (None, [], False):
            raise _unsupported(name, f"'{name}' is not supported by this platform.")
    n = body.get("n")
    if n is not None and n != 1:
        raise _unsupported("n", "Only n=1 is supported: one choice per request.")
    response_format = body.get("response_format")
    if response_format is not None:
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind != "text":
            raise _unsupported(
                "response_format",
                "Only response_format {'type': 'text'} is supported (no JSON mode or schema).",
            )
    modalities = body.get("modalities")
    if modalities is not None and (not isinstance(modalities, list) or set(modalities) - {"text"}):
        raise _unsupported("modalities", "Only the 'text' output modality is supported (no audio).")


def parse_chat_request(body: dict[str, Any], *, max_tokens_limit: int) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(
            400, "'model' is required and must be a string.", code="missing_required_parameter", param="model"
        )

    raw_messages = body.get("messages")
    if not isinstance(raw_messages, list) or not raw_messages:
        raise ApiError(
            400, "'messages' must be a non-empty list.", code="missing_required_parameter", param="messages"
        )
    images: list[ImagePart] = []
    videos: list[VideoPart] = []
    messages: list[dict[str, Any]] = []
    for index, message in enumerate(raw_messages):
        if not isinstance(message, dict):
            raise _invalid(f"messages[{index}]", f"'messages[{index}]' must be an object.")
        role = message.get("role")
        if role not in ROLES:
            raise _invalid(
                f"messages[{index}].role", f"'messages[{index}].role' must be one of {sorted(ROLES)}."
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        messages.append(
            {
                "role": "system" if role == "developer" else role,
                "content": _content(index, content, images, videos),
            }
        )

    _refuse_unsupported(body)

    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    if max_tokens is None:
        max_tokens = min(256, max_tokens_limit)
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= max_tokens_limit
    ):
        raise _invalid(param, f"'{param}' must be an integer from 1 to {max_tokens_limit}.")

    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise _invalid("seed", "'seed' must be a non-negative integer.")

    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP_SEQUENCES
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise _invalid(
            "stop", f"'stop' must be a non-empty string or a list of up to {MAX_STOP_SEQUENCES} of them."
        )

    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _invalid("stream", "'stream' must be a boolean.")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise _invalid("stream_options", "'stream_options' must be an object.")

    cache_salt = body.get("cache_salt")
    if cache_salt is not None and (
        not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= MAX_CACHE_SALT_LENGTH
    ):
        raise _invalid(
            "cache_salt", f"'cache_salt' must be a string of 1 to {MAX_CACHE_SALT_LENGTH} characters."
        )

    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise _invalid("logprobs", "'logprobs' must be a boolean.")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        if isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int):
            raise _invalid("top_logprobs", "'top_logprobs' must be an integer.")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise _invalid("top_logprobs", f"'top_logprobs' must be from 0 to {MAX_TOP_LOGPROBS}.")
        if not logprobs:
            raise _invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true.")

    return ChatRequest(
        model=model,
        messages=messages,
        images=images,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=bool(stream_options.get("include_usage", False)),
        videos=videos,
        cache_salt=cache_salt,
        logprobs=bool(logprobs),
        top_logprobs=top_logprobs or 0,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )


def _logit_bias(raw: Any) -> dict[int, float]:
    """OpenAI's `logit_bias`: token ids (as JSON object keys) to a bias from -100 to 100."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise _invalid("logit_bias", "'logit_bias' must be an object of token id to bias.")
    if len(raw) > MAX_LOGIT_BIAS_ENTRIES:
        raise _invalid("logit_bias", f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens.")
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise _invalid("logit_bias", f"'logit_bias' keys must be token ids; got {key[:20]!r}.")
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _invalid("logit_bias", f"'logit_bias[{key}]' must be a number.")
        if not -100 <= value <= 100:
            raise _invalid("logit_bias", f"'logit_bias[{key}]' must be from -100 to 100; got {value}.")
        bias[int(key)] = float(value)
    return bias
