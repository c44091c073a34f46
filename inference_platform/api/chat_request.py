"""Validation of an OpenAI chat completion request body, once, at the edge.

Every problem becomes an ApiError naming the offending field (`param`, the path into the body:
`messages[0].content[1].image_url.url`), so clients see what to fix; nothing past this module has
to re-check shapes. The type of every field is checked before its value is used, so no JSON value
of any type reaches a comparison, a hash or a set lookup it was not made for.

Hostile strings inside fields of the right type, decided per field:
- A lone surrogate (`"\ud800"`, which JSON can spell and Python's decoder keeps) is refused in
  every string the platform keeps (text, stop sequences, URLs, `cache_salt`, `user`, `name`,
  `model`): it is not a character, has no UTF-8 form, and so can be neither tokenised, hashed nor
  sent on; a 400 naming the field says so.
- NUL and other control characters are characters: accepted in free text (content, stop,
  `cache_salt`, `user`, `name`), as any UTF-8 API takes them.
- A model's control tokens (`<|im_start|>`, `<|vision_start|>`) in text are accepted and stay
  text: the prompt renderer keeps them literal, only the chat template makes roles and
  placeholders.
- Length: free text is bounded by the body limit and the model's context, not here; the fields
  with a bound of their own (`cache_salt`, `user`, `stop`'s count) say so in the OpenAPI document.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from inference_platform.api.errors import ApiError
from inference_platform.serving.chat import ChatRequest, ImagePart, VideoPart
from routing.admission.queue import MAX_PRIORITY

ROLES = {"system", "user", "assistant", "developer", "tool"}
MAX_STOP_SEQUENCES = 4
# Far deeper than any chat request needs, far shallower than the parser's recursion limit.
MAX_JSON_DEPTH = 400
MAX_CACHE_SALT_LENGTH = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_SEED = 2**63 - 1  # the worker's generator takes a signed 64-bit seed
MAX_USER_LENGTH = 256
# The media URLs the platform fetches or decodes (the media layer checks the rest). Written for
# both Python's `re` and the ECMA dialect of the OpenAPI document's `pattern`: no inline flags.
MEDIA_URL_PATTERN = r"^([hH][tT][tT][pP][sS]?://|[dD][aA][tT][aA]:)"
_MEDIA_URL = re.compile(MEDIA_URL_PATTERN)

# Fields OpenAI defines that this platform cannot honour: refused by name rather than silently
# ignored (a caller relying on them must know). Unknown fields stay ignored, as OpenAI does.
DEFAULT_MAX_TOKENS = 256  # a request without max_tokens (capped by MAX_TOKENS_LIMIT)
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


def _shown(value: Any) -> str:
    """A client's value quoted in a message: short, and printable whatever it holds."""
    shown = json.dumps(value)  # ASCII only: a lone surrogate or a NUL is written as its escape
    return shown if len(shown) <= 40 else shown[:37] + "..."


def _text(value: Any, param: str, *, required: bool = True, what: str = "a string") -> str:
    """`value` as a string the platform can keep: any characters but lone surrogates."""
    if not isinstance(value, str) or (required and not value):
        raise _invalid(param, f"'{param}' must be {what}.")
    if value.isascii():  # most text, and every data URL: no copy made to find out
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise _invalid(
            param,
            f"'{param}' holds a lone surrogate ({value[exc.start]!a} at {exc.start}), which is not a "
            "character and has no UTF-8 form; send the text as valid Unicode.",
        ) from None
    return value


def _integer(value: Any, param: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _invalid(param, f"'{param}' must be an integer from {low} to {high}.")
    return value


def _boolean(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise _invalid(param, f"'{param}' must be a boolean.")
    return value


def _finite_number(value: Any, param: str) -> float:
    """A JSON number as a float; refused: other types, NaN and Infinity (Python's JSON reads
    them), and integers too large for a float (`math.isfinite` would raise on them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _invalid(param, f"'{param}' must be a number.")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise _invalid(param, f"'{param}' must be a finite number; got {_shown(value)[:20]}.")
    return number


def _number(
    body: dict[str, Any], name: str, default: float, low: float, high: float, *, low_open=False
) -> float:
    value = body.get(name)
    if value is None:
        return default
    number = _finite_number(value, name)
    if number > high or number < low or (low_open and number == low):
        bound = f"greater than {low}" if low_open else f"at least {low}"
        raise _invalid(name, f"'{name}' must be {bound} and at most {high}; got {number}.")
    return number


def _media_url(part: dict[str, Any], key: str, part_param: str) -> str:
    """The URL of an `image_url` or `video_url` part: `{"url": ...}`, or the URL alone (a
    shorthand some clients send)."""
    holder = part.get(key)
    param = f"{part_param}.{key}"
    if isinstance(holder, str):
        url, url_param = holder, param
    elif isinstance(holder, dict):
        url, url_param = holder.get("url"), f"{param}.url"
    else:
        raise _invalid(param, f"'{param}' must be an object with a 'url'.")
    url = _text(url, url_param, what="a non-empty URL string")
    if not _MEDIA_URL.match(url):
        raise _invalid(url_param, f"'{url_param}' must be an http(s) or data: URL; got {_shown(url)}.")
    return url


def _content(
    message_index: int, content: Any, images: list[ImagePart], videos: list[VideoPart]
) -> str | list[dict[str, Any]]:
    param = f"messages[{message_index}].content"
    if isinstance(content, str):
        return _text(content, param, required=False)
    if not isinstance(content, list):
        raise _invalid(param, f"'{param}' must be a string or a list of content parts.")
    parts: list[dict[str, Any]] = []
    for part_index, part in enumerate(content):
        part_param = f"{param}[{part_index}]"
        if not isinstance(part, dict):
            raise _invalid(part_param, f"'{part_param}' must be an object with a 'type'.")
        kind = part.get("type")
        if not isinstance(kind, str):
            raise _invalid(f"{part_param}.type", f"'{part_param}.type' must be a string.")
        if kind == "text":
            text = _text(part.get("text"), f"{part_param}.text", required=False)
            parts.append({"type": "text", "text": text})
        elif kind == "image_url":
            url = _media_url(part, "image_url", part_param)
            image = part["image_url"]
            detail = image.get("detail") if isinstance(image, dict) else None
            if detail is not None and (not isinstance(detail, str) or detail not in ("auto", "low", "high")):
                param_detail = f"{part_param}.image_url.detail"
                raise _invalid(param_detail, f"'{param_detail}' must be one of auto, low, high.")
            images.append(
                ImagePart(index=len(images), url=url, detail=detail, param=f"{part_param}.image_url")
            )
            # transformers' chat templates know images as {"type": "image"}; Qwen's also
            # accepts OpenAI's image_url form, most others (Gemma, LLaVA) do not.
            parts.append({"type": "image", "url": url})
        elif kind == "video_url":  # as vLLM and Dynamo take it
            url = _media_url(part, "video_url", part_param)
            videos.append(VideoPart(index=len(videos), url=url, param=f"{part_param}.video_url"))
            # transformers' chat templates know videos as {"type": "video"}.
            parts.append({"type": "video", "url": url})
        else:
            raise ApiError(
                400,
                f"Content part type {_shown(kind)} is not supported here (text, image_url, video_url).",
                code="unsupported_content",
                param=f"{part_param}.type",
            )
    return parts


def _unsupported(param: str, message: str) -> ApiError:
    return ApiError(400, message, code="unsupported_parameter", param=param)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    for name in UNSUPPORTED_FIELDS:
        value = body.get(name)
        # Their empty forms ask for nothing and pass (0 is not False here: `0 in (False,)` is).
        if not (value is None or value is False or value == []):
            raise _unsupported(name, f"'{name}' is not supported by this platform.")
    n = body.get("n")
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise _invalid("n", "'n' must be an integer.")
        if n != 1:
            raise _unsupported("n", "Only n=1 is supported: one choice per request.")
    response_format = body.get("response_format")
    if response_format is not None:
        if not isinstance(response_format, dict):
            raise _invalid("response_format", "'response_format' must be an object with a 'type'.")
        if response_format.get("type") != "text":
            raise _unsupported(
                "response_format.type",
                "Only response_format {'type': 'text'} is supported (no JSON mode or schema).",
            )
    modalities = body.get("modalities")
    if modalities is not None:
        if not isinstance(modalities, list):
            raise _invalid("modalities", "'modalities' must be a list.")
        for index, modality in enumerate(modalities):
            if modality != "text" or not isinstance(modality, str):
                raise _unsupported(
                    f"modalities[{index}]", "Only the 'text' output modality is supported (no audio)."
                )


def parse_chat_request(body: dict[str, Any], *, max_tokens_limit: int) -> ChatRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(
            400, "'model' is required and must be a string.", code="missing_required_parameter", param="model"
        )
    _text(model, "model")

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
        if not isinstance(role, str) or role not in ROLES:  # a list or an object is not hashable
            raise _invalid(
                f"messages[{index}].role", f"'messages[{index}].role' must be one of {sorted(ROLES)}."
            )
        if message.get("name") is not None:  # OpenAI's participant name: checked, not used
            _text(message["name"], f"messages[{index}].name", required=False)
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
        max_tokens = min(DEFAULT_MAX_TOKENS, max_tokens_limit)
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= max_tokens_limit
    ):
        raise _invalid(param, f"'{param}' must be an integer from 1 to {max_tokens_limit}.")

    seed = body.get("seed")
    if seed is not None:
        _integer(seed, "seed", 0, MAX_SEED)

    stop = _stop(body.get("stop"))

    stream = body.get("stream")
    stream = False if stream is None else _boolean(stream, "stream")
    stream_options = body.get("stream_options")
    if stream_options is None:
        stream_options = {}
    if not isinstance(stream_options, dict):
        raise _invalid("stream_options", "'stream_options' must be an object.")
    include_usage = stream_options.get("include_usage")
    include_usage = (
        False if include_usage is None else _boolean(include_usage, "stream_options.include_usage")
    )

    cache_salt = body.get("cache_salt")
    if cache_salt is not None:
        what = f"a string of 1 to {MAX_CACHE_SALT_LENGTH} characters"
        if not isinstance(cache_salt, str) or len(cache_salt) > MAX_CACHE_SALT_LENGTH:
            raise _invalid("cache_salt", f"'cache_salt' must be {what}.")
        _text(cache_salt, "cache_salt", what=what)

    user = body.get("user")  # OpenAI's end-user id: checked as OpenAI does, not used
    if user is not None:
        what = f"a string of at most {MAX_USER_LENGTH} characters"
        if not isinstance(user, str) or len(user) > MAX_USER_LENGTH:
            raise _invalid("user", f"'user' must be {what}.")
        _text(user, "user", required=False, what=what)

    logprobs = body.get("logprobs")
    logprobs = False if logprobs is None else _boolean(logprobs, "logprobs")
    top_logprobs = body.get("top_logprobs")
    if top_logprobs is not None:
        _integer(top_logprobs, "top_logprobs", 0, MAX_TOP_LOGPROBS)
        if not logprobs:
            raise _invalid("top_logprobs", "'top_logprobs' needs 'logprobs': true.")

    priority = body.get("priority")
    if priority is not None:
        _integer(priority, "priority", 0, MAX_PRIORITY)

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
        include_usage=include_usage,
        videos=videos,
        cache_salt=cache_salt,
        logprobs=logprobs,
        top_logprobs=top_logprobs or 0,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=_logit_bias(body.get("logit_bias")),
        priority=priority,
    )


def _stop(raw: Any) -> list[str]:
    """OpenAI's `stop`: a string or a list of up to MAX_STOP_SEQUENCES of them, none empty."""
    what = f"a non-empty string or a list of up to {MAX_STOP_SEQUENCES} of them"
    if raw is None:
        return []
    if isinstance(raw, str):
        return [_text(raw, "stop", what=what)]
    if not isinstance(raw, list) or len(raw) > MAX_STOP_SEQUENCES:
        raise _invalid("stop", f"'stop' must be {what}.")
    return [_text(item, f"stop[{index}]", what="a non-empty string") for index, item in enumerate(raw)]


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
            raise _invalid("logit_bias", f"'logit_bias' keys must be token ids; got {_shown(key)}.")
        param = f"logit_bias.{key}"
        number = _finite_number(value, param)
        if not -100 <= number <= 100:
            raise _invalid(param, f"'{param}' must be from -100 to 100; got {number}.")
        bias[int(key)] = number
    return bias
