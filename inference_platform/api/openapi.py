"""The OpenAPI 3 description of the public API, served at `/v1/openapi.json`, and its docs page.

Written by hand (the views are async Django views, which drf-spectacular cannot introspect) and
checked twice by the suite: `openapi-spec-validator` validates the document, and schemathesis
sends hundreds of generated requests to a live server and validates every answer against it.
Bounds that depend on the deployment (the served model, `MAX_TOKENS_LIMIT`) are filled in from
settings, so the document always says what this server accepts.
"""

from __future__ import annotations

import base64
import functools
import io
import re
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe
from PIL import Image

from inference_platform.api.boundary import only_get
from inference_platform.api.chat_request import (
    DEFAULT_MAX_TOKENS,
    MAX_CACHE_SALT_LENGTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_SEED,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
    MAX_USER_LENGTH,
    MEDIA_URL_PATTERN,
    ROLES,
)
from inference_platform.serving.prepare import served_model
from routing.admission.queue import MAX_PRIORITY

_JSON = "application/json"


def default_max_tokens(max_tokens_limit: int) -> int:
    """What a request that names no `max_tokens` gets (as `parse_chat_request` fills it in)."""
    return min(DEFAULT_MAX_TOKENS, max_tokens_limit)


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_response(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {_JSON: {"schema": _ref("Error")}}}
    if headers:
        response["headers"] = headers
    return response


_RATE_LIMIT_HEADERS = {
    f"x-ratelimit-{what}-{kind}": {
        "description": f"{meaning.format(unit=unit)} Sent only when the tenant has that limit.",
        "schema": {"type": "string" if what == "reset" else "integer"},
    }
    for kind, unit in (("requests", "requests"), ("tokens", "prompt tokens"))
    for what, meaning in (
        ("limit", "The tenant's {unit} per minute."),
        ("remaining", "The {unit} left of the tenant's per-minute budget."),
        ("reset", "How long until the tenant's {unit} budget is full again (e.g. `1s`, `6m0s`)."),
    )
}

_ERRORS = {
    "400": _error_response(
        "The request is invalid; `error.param` names the field. Codes: `invalid_value`, "
        "`missing_required_parameter`, `unsupported_parameter`, `unsupported_content`, `invalid_json`, "
        "`invalid_messages`, `invalid_session_scope`, `context_length_exceeded` (the prompt and "
        "`max_tokens` together exceed the model's maximum context, both counts in the message), and "
        "for an image or video `invalid_url`, `unknown_host`, `invalid_data_url`, `image_undecodable`, "
        "`origin_error`, `origin_timeout` (its origin failed), `video_undecodable`, `video_truncated`."
    ),
    "401": _error_response(
        "Missing, wrong, revoked or expired API key (`missing_api_key`, `invalid_api_key`); the header "
        "must be `Authorization: Bearer <key>`."
    ),
    "403": _error_response(
        "`address_refused`: an image or video URL at an internal address (loopback, private, link-local, "
        "metadata); an operator allows such hosts with `MEDIA_ALLOWED_HOSTS`, on the API server and every "
        "worker."
    ),
    "404": _error_response("`model_not_found`: the model is not served; `not_found`: no such endpoint."),
    "409": _error_response(
        "`image_changed`: a picture changed at its origin while the request was routed; send it again."
    ),
    "413": _error_response(
        "`request_too_large` (the body is over `API_MAX_BODY_MB`), `image_too_large` (over "
        "`DYN_MM_MAX_FILE_SIZE_MB`), `video_too_long`, `video_too_large`, `video_frame_too_large`."
    ),
    "415": _error_response("`unsupported_media_type`: the body is not application/json."),
    "422": _error_response(
        "`image_size_refused`, `image_refused`, `decompression_bomb`: an image the model cannot take "
        "(its size); `video_decode_timeout`."
    ),
    "429": _error_response(
        "`rate_limit_exceeded`: over one of the tenant's limits (requests or prompt tokens per minute, "
        "concurrent requests); `request_too_large`: the prompt alone is over the tenant's tokens per "
        "minute; `tenant_queue_full`: too many of the tenant's own requests at this priority wait for "
        "a worker already.",
        {
            "Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}},
            **{
                name: spec
                for name, spec in _RATE_LIMIT_HEADERS.items()
                if name.startswith("x-ratelimit-remaining") or name.startswith("x-ratelimit-reset")
            },
        },
    ),
    "502": _error_response(
        "`worker_error`, `worker_vanished`: the worker failed or stopped while answering."
    ),
    "503": _error_response(
        "`no_live_worker`, `all_workers_busy` (the admission queue off), `queue_full`, `queue_timeout` "
        "(waited `ROUTER_QUEUE_MAX_WAIT_SECS` for a worker), `model_unavailable`, `state_unavailable`, "
        "`broker_unavailable`: the platform cannot take the request now. `Retry-After`, where given, is "
        "the queue's wait at its recent drain rate.",
        {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}},
    ),
    "504": _error_response("`worker_timeout`: the worker did not answer in time."),
}

_ROUTING_HEADERS = {
    "X-Request-Id": {"description": "The request's id (also in the answer).", "schema": {"type": "string"}},
    "X-Routed-Worker": {"description": "The worker that served the request.", "schema": {"type": "string"}},
    "X-Routing-Overlap": {
        "description": "Cached prefix blocks of the chosen worker / the prompt's blocks, in the caller's "
        "own cache partition.",
        "schema": {"type": "string", "pattern": r"^\d+/\d+$"},
    },
    "X-Encoder-Calls": {
        "description": "Non-streamed answers: how often the worker ran its vision encoder for the request "
        "(0: every image and video came from its cached prefix or its embedding cache).",
        "schema": {"type": "integer", "minimum": 0},
    },
    **_RATE_LIMIT_HEADERS,
}


def _schemas(model_name: str, max_tokens_limit: int) -> dict[str, Any]:
    nullable_string = {"type": "string", "nullable": True}
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    image_url = {
        "type": "string",
        "pattern": MEDIA_URL_PATTERN,
        "description": "An http(s) URL or a data:image/...;base64 URL.",
    }
    image_part = _media_part(
        "image_url",
        {
            "url": image_url,
            "detail": {"type": "string", "enum": ["auto", "low", "high", None], "nullable": True},
        },
    )
    video_part = _media_part(
        "video_url",
        {"url": {**image_url, "description": "An http(s) URL or a data:video/...;base64 URL."}},
    )
    video_part["description"] = (
        "A video (as vLLM and Dynamo take it; not part of OpenAI's API), decoded and sampled by the API "
        "server as the model's video processor samples it; limits `VIDEO_MAX_DURATION_SECS`, "
        "`VIDEO_MAX_FRAMES`, `VIDEO_MAX_PIXELS_PER_FRAME`, `VIDEO_MAX_TOTAL_PIXELS`, "
        "`VIDEO_DECODE_DEADLINE_SECS`."
    )
    token_logprob = {
        "type": "object",
        "required": ["token", "logprob", "bytes", "top_logprobs"],
        "properties": {
            "token": {"type": "string"},
            "logprob": {"type": "number", "maximum": 0},
            "bytes": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 255},
                "nullable": True,
            },
            "top_logprobs": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["token", "logprob", "bytes"],
                    "properties": {
                        "token": {"type": "string"},
                        "logprob": {"type": "number", "maximum": 0},
                        "bytes": {
                            "type": "array",
                            "items": {"type": "integer", "minimum": 0, "maximum": 255},
                            "nullable": True,
                        },
                    },
                },
            },
        },
    }
    logprobs = {
        "type": "object",
        "nullable": True,
        "required": ["content"],
        "properties": {"content": {"type": "array", "items": _ref("TokenLogprob"), "nullable": True}},
    }
    schemas = {
        "Error": {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type", "param", "code"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": nullable_string,
                        "code": nullable_string,
                    },
                }
            },
        },
        "Model": {
            "type": "object",
            "required": ["id", "object", "created", "owned_by"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["model"]},
                "created": {"type": "integer"},
                "owned_by": {"type": "string"},
            },
        },
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"type": "string", "enum": ["list"]},
                "data": {"type": "array", "items": _ref("Model")},
            },
        },
        "TextPart": text_part,
        "ImagePart": image_part,
        "VideoPart": video_part,
        "Message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"type": "string", "enum": sorted(ROLES)},
                "content": {
                    "oneOf": [
                        {"type": "string"},
                        {
                            "type": "array",
                            "items": {"oneOf": [_ref("TextPart"), _ref("ImagePart"), _ref("VideoPart")]},
                        },
                    ]
                },
                "name": {"type": "string"},
            },
        },
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                "model": {"type": "string", "enum": [model_name], "description": "The served model's id."},
                "messages": {"type": "array", "minItems": 1, "items": _ref("Message")},
                "max_tokens": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": max_tokens_limit,
                    "default": default_max_tokens(max_tokens_limit),
                    "description": f"Tokens to generate at most; {default_max_tokens(max_tokens_limit)} when "
                    f"omitted, at most `MAX_TOKENS_LIMIT` ({max_tokens_limit}). The prompt and this "
                    "together must fit the model's context (`context_length_exceeded` otherwise).",
                },
                "max_completion_tokens": {
                    "type": "integer",
                    "minimum": 1,
                    "maximum": max_tokens_limit,
                    "default": default_max_tokens(max_tokens_limit),
                    "description": "The same as `max_tokens` (OpenAI's newer name); wins when both are sent.",
                },
                "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
                "seed": {"type": "integer", "minimum": 0, "maximum": MAX_SEED},
                "stop": {
                    "oneOf": [
                        {"type": "string", "minLength": 1},
                        {
                            "type": "array",
                            "maxItems": MAX_STOP_SEQUENCES,
                            "items": {"type": "string", "minLength": 1},
                        },
                    ]
                },
                "stream": {"type": "boolean"},
                "stream_options": {
                    "type": "object",
                    "properties": {"include_usage": {"type": "boolean"}},
                },
                "n": {"type": "integer", "enum": [1], "description": "Only one choice per request."},
                "logprobs": {"type": "boolean"},
                "top_logprobs": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_TOP_LOGPROBS,
                    "description": "Needs `logprobs: true`.",
                },
                "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
                "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
                "logit_bias": {
                    "type": "object",
                    "description": "Token id (as a string) to a bias from -100 to 100.",
                    "maxProperties": MAX_LOGIT_BIAS_ENTRIES,
                    "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                },
                "response_format": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"type": "string", "enum": ["text"]}},
                },
                "modalities": {
                    "type": "array",
                    "items": {"type": "string", "enum": ["text"]},
                    "description": "Only text output.",
                },
                "user": {
                    "type": "string",
                    "maxLength": MAX_USER_LENGTH,
                    "description": "The end user's id, as OpenAI takes it (accepted, not used).",
                },
                "cache_salt": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_CACHE_SALT_LENGTH,
                    "description": "Narrows the caller's cache partition further (as vLLM's `cache_salt`).",
                },
                "priority": {
                    "type": "integer",
                    "minimum": 0,
                    "maximum": MAX_PRIORITY,
                    "description": "Higher waits less: while every worker is busy, requests wait in "
                    "priority bands (each band fair between tenants), and a worker's engine starts "
                    "waiting prompts of a higher priority first. At most the tenant's maximum (a 400 "
                    "above it); absent: the tenant's default. The `x-priority` header says the same "
                    "for clients that cannot add a field.",
                },
            },
            "example": {
                "model": model_name,
                "messages": [{"role": "user", "content": "Describe a red bicycle."}],
                "max_tokens": min(4, max_tokens_limit),
                "stream": True,
                "stream_options": {"include_usage": True},
                "logprobs": True,
            },
            "description": "OpenAI's chat completion request. `tools`, `tool_choice`, `functions`, "
            "`response_format` other than text, audio and `n` > 1 are refused with a 400 "
            "`unsupported_parameter`; other unknown fields are ignored.",
        },
        "Usage": {
            "type": "object",
            "required": ["prompt_tokens", "completion_tokens", "total_tokens", "prompt_tokens_details"],
            "properties": {
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "completion_tokens": {"type": "integer", "minimum": 0},
                "total_tokens": {"type": "integer", "minimum": 0},
                "prompt_tokens_details": {
                    "type": "object",
                    "required": ["cached_tokens"],
                    "properties": {"cached_tokens": {"type": "integer", "minimum": 0}},
                },
            },
        },
        "TokenLogprob": token_logprob,
        "ChatCompletion": {
            "type": "object",
            "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["chat.completion"]},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["index", "message", "logprobs", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer", "enum": [0]},
                            "message": {
                                "type": "object",
                                "required": ["role", "content"],
                                "properties": {
                                    "role": {"type": "string", "enum": ["assistant"]},
                                    "content": nullable_string,
                                },
                            },
                            "logprobs": logprobs,
                            "finish_reason": {"type": "string", "enum": ["stop", "length"]},
                        },
                    },
                },
                "usage": _ref("Usage"),
            },
        },
        "ChatCompletionChunk": {
            "type": "object",
            "description": "One server-sent event (`data: <chunk>`) of a streamed answer; the stream "
            "ends with `data: [DONE]`. With `stream_options.include_usage`, a last chunk has no "
            "choices and carries `usage`. The stream starts with the first token: a failure before it "
            "is the response's own status; a failure after it is one `data:` event holding an `Error`.",
            "required": ["id", "object", "created", "model", "choices"],
            "properties": {
                "id": {"type": "string"},
                "object": {"type": "string", "enum": ["chat.completion.chunk"]},
                "created": {"type": "integer"},
                "model": {"type": "string"},
                "choices": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["index", "delta", "finish_reason"],
                        "properties": {
                            "index": {"type": "integer"},
                            "delta": {
                                "type": "object",
                                "properties": {
                                    "role": {"type": "string", "enum": ["assistant"]},
                                    "content": {"type": "string"},
                                },
                            },
                            "logprobs": {
                                **logprobs,
                                "description": "With `logprobs: true`: on each content chunk, the "
                                "entries of the tokens whose text that chunk completes; on the chunk "
                                "with `finish_reason`, those of tokens no content chunk carried (a "
                                "stop string's), else null. Joined in order they equal the "
                                "non-streamed `logprobs.content`.",
                            },
                            # OpenAPI 3.0: a nullable enum lists null among its values.
                            "finish_reason": {
                                "type": "string",
                                "enum": ["stop", "length", None],
                                "nullable": True,
                            },
                        },
                    },
                },
                "usage": _ref("Usage"),
            },
        },
        "ServerSentEvent": {
            "type": "object",
            "required": ["data"],
            "description": "One event of a streamed answer: `data` holds a `ChatCompletionChunk` as JSON, "
            "an `Error` as JSON (a failure after the stream began), or `[DONE]` (the last event).",
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
            },
        },
        "RouteDescription": {
            "type": "object",
            "required": ["model", "prompt_tokens", "block_size", "block_hashes", "candidates"],
            "properties": {
                "model": {"type": "string"},
                "family": nullable_string,
                "prompt_tokens": {"type": "integer", "minimum": 0},
                "block_size": {"type": "integer", "minimum": 1},
                "total_blocks": {"type": "integer", "minimum": 0},
                "block_hashes": {"type": "array", "items": {"type": "integer"}},
                "images": {"type": "array", "items": {"type": "object"}},
                "videos": {"type": "array", "items": {"type": "object"}},
                "choice": {
                    "type": "object",
                    "nullable": True,
                    "description": "The worker the router would choose now (null: every worker is busy).",
                    "properties": {
                        "worker": {"type": "string"},
                        "overlap": {"type": "integer"},
                        "best_overlap": {"type": "integer"},
                        "reason": {"type": "string"},
                    },
                },
                "candidates": {
                    "type": "array",
                    "description": "Every worker of the model: eligible or why not, and for eligible "
                    "ones its overlap (cached leading blocks), prefill and decode blocks and cost.",
                    "items": {
                        "type": "object",
                        "required": ["worker", "eligible"],
                        "properties": {
                            "worker": {"type": "string"},
                            "eligible": {"type": "boolean"},
                            "ineligible_because": nullable_string,
                            "busy": {"type": "boolean"},
                            "overlap": {"type": "integer"},
                            "prefill_blocks": {"type": "number"},
                            "decode_blocks": {"type": "number"},
                            "cost": {"type": "number"},
                        },
                    },
                },
            },
        },
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {"status": {"type": "string", "enum": ["ok"]}},
        },
        "Readiness": {
            "type": "object",
            "required": ["status", "redis"],
            "properties": {
                "status": {"type": "string", "enum": ["ready", "unavailable"]},
                "redis": {"type": "string"},
                "live_workers": {"type": "integer", "minimum": 0},
                "accepting_workers": {"type": "integer", "minimum": 0},
                "reason": {"type": "string"},
            },
        },
    }
    request = schemas["ChatCompletionRequest"]
    for name, spec in request["properties"].items():
        if name not in request["required"]:
            _nullable(spec)
    _nullable(schemas["Message"]["properties"]["name"])
    _nullable(request["properties"]["stream_options"]["properties"]["include_usage"])
    return schemas


def _media_part(kind: str, fields: dict[str, Any]) -> dict[str, Any]:
    """A content part holding a media URL: `{"type": kind, kind: {"url": ...}}`, or the URL
    alone in place of the object (a shorthand some clients send, which the parser takes)."""
    return {
        "type": "object",
        "required": ["type", kind],
        "properties": {
            "type": {"type": "string", "enum": [kind]},
            kind: {
                "oneOf": [
                    {"type": "object", "required": ["url"], "properties": fields},
                    fields["url"],
                ]
            },
        },
    }


def _nullable(spec: dict[str, Any]) -> None:
    """An optional field the parser also takes as null, meaning its default (as OpenAI's own
    document has them); OpenAPI 3.0: a nullable enum lists null among its values."""
    if "oneOf" in spec:  # null matches one branch only, as `oneOf` needs
        _nullable(spec["oneOf"][0])
        return
    spec["nullable"] = True
    if "enum" in spec:
        spec["enum"] = [*spec["enum"], None]


def openapi_document(model_name: str, max_tokens_limit: int) -> dict[str, Any]:
    unauthorized = {"401": _ERRORS["401"]}
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "Multimodal KV-routed inference platform",
            "version": "1",
            "description": "OpenAI-compatible chat completions for vision-language models, routed to the "
            "worker whose KV cache holds the longest prefix of the prompt. Every /v1/* call needs "
            "`Authorization: Bearer <API key>`; keys belong to tenants, whose caches are isolated.",
        },
        "servers": [{"url": "/"}],
        "security": [{"bearerAuth": []}],
        "paths": {
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "summary": "The served model",
                    "responses": {
                        "200": {
                            "description": "The models",
                            "content": {_JSON: {"schema": _ref("ModelList")}},
                        },
                        **unauthorized,
                    },
                }
            },
            "/v1/models/{model_id}": {
                "get": {
                    "operationId": "retrieveModel",
                    "summary": "One model by id",
                    "parameters": [
                        {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
                    ],
                    "responses": {
                        "200": {"description": "The model", "content": {_JSON: {"schema": _ref("Model")}}},
                        "404": _ERRORS["404"],
                        **unauthorized,
                    },
                }
            },
            "/v1/chat/completions": {
                "post": {
                    "operationId": "createChatCompletion",
                    "summary": "A chat completion, whole or streamed (server-sent events)",
                    "parameters": [
                        {
                            "name": "x-priority",
                            "in": "header",
                            "required": False,
                            "description": "The request's priority when its body names none "
                            "(see `priority`).",
                            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PRIORITY},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {_JSON: {"schema": _ref("ChatCompletionRequest")}},
                    },
                    "responses": {
                        "200": {
                            "description": "The answer: JSON, or with `stream: true` a text/event-stream of "
                            "`ChatCompletionChunk` events ending with `data: [DONE]`.",
                            "headers": _ROUTING_HEADERS,
                            "content": {
                                _JSON: {"schema": _ref("ChatCompletion")},
                                # Before OpenAPI 3.2, an event stream's schema is each event's.
                                "text/event-stream": {"schema": _ref("ServerSentEvent")},
                            },
                        },
                        **_ERRORS,
                    },
                }
            },
            "/v1/route": {
                "post": {
                    "operationId": "route",
                    "summary": "Operators: what the router sees of a chat request (its token view, block "
                    "hashes, images, and each worker's overlap, load and cost), without sending it",
                    "description": "Needs a staff key. Computed in the caller's own cache partition. "
                    "`manage.py inspect_request FILE.json` prints the same from a file.",
                    "requestBody": {
                        "required": True,
                        "content": {_JSON: {"schema": _ref("ChatCompletionRequest")}},
                    },
                    "responses": {
                        "200": {
                            "description": "The request in the router's eyes",
                            "headers": {"X-Request-Id": _ROUTING_HEADERS["X-Request-Id"]},
                            "content": {_JSON: {"schema": _ref("RouteDescription")}},
                        },
                        "403": _error_response("`operator_only`: the key is not a staff key."),
                        **{code: _ERRORS[code] for code in ("400", "401", "404", "413", "415", "422")},
                        **{code: _ERRORS[code] for code in ("502", "503", "504")},
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "summary": "Operators: Prometheus metrics of every frontend and worker "
                    "(OpenMetrics with `Accept: application/openmetrics-text`)",
                    "description": "Needs a staff key, or `Authorization: Bearer <METRICS_TOKEN>`. The "
                    "metrics are listed in README.md.",
                    "responses": {
                        "200": {
                            "description": "The metrics",
                            "content": {
                                "text/plain": {"schema": {"type": "string"}},
                                "application/openmetrics-text": {"schema": {"type": "string"}},
                            },
                        },
                        **unauthorized,
                        "403": _error_response("`operator_only`: neither a staff key nor the metrics token."),
                    },
                }
            },
            "/health": {
                "get": {
                    "operationId": "health",
                    "summary": "Liveness: the process answers",
                    "security": [],
                    "responses": {
                        "200": {"description": "Alive", "content": {_JSON: {"schema": _ref("Health")}}}
                    },
                }
            },
            "/ready": {
                "get": {
                    "operationId": "ready",
                    "summary": "Readiness: Redis answers and at least one live worker serves the model",
                    "security": [],
                    "responses": {
                        "200": {"description": "Ready", "content": {_JSON: {"schema": _ref("Readiness")}}},
                        "503": {
                            "description": "Not ready",
                            "content": {_JSON: {"schema": _ref("Readiness")}},
                        },
                    },
                }
            },
        },
        "components": {
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
            "schemas": _schemas(model_name, max_tokens_limit),
        },
    }


def current_document() -> dict[str, Any]:
    return openapi_document(served_model().name, settings.MAX_TOKENS_LIMIT)


@only_get
def openapi_json(request: HttpRequest) -> HttpResponse:
    """The document itself: public, like any API's reference (it holds no secret)."""
    return JsonResponse(current_document(), json_dumps_params={"indent": 1})


@functools.lru_cache(maxsize=1)
def example_image_data_url() -> str:
    """A small picture inside the docs' example, so the example runs as pasted: no origin to
    reach, and none the SSRF guard would refuse (a loopback one, say) or that could go away."""
    buffer = io.BytesIO()
    Image.new("RGB", (56, 56), (200, 30, 40)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _limits() -> list[tuple[str, str]]:
    """What bounds a request, with the setting that sets each (the docs page's "Limits")."""
    max_tokens = settings.MAX_TOKENS_LIMIT
    return [
        (
            "`max_tokens`",
            f"{default_max_tokens(max_tokens)} when omitted; at most {max_tokens} (`MAX_TOKENS_LIMIT`).",
        ),
        (
            "context",
            "the prompt's tokens plus `max_tokens` must fit a worker's KV cache; a 400 "
            "`context_length_exceeded` names the maximum and both counts.",
        ),
        ("request body", f"{settings.API_MAX_BODY_BYTES / 2**20:.1f} MiB (`API_MAX_BODY_MB`); a 413 beyond."),
        (
            "image",
            f"{settings.DYN_MM_MAX_FILE_SIZE_MB:g} MiB (`DYN_MM_MAX_FILE_SIZE_MB`); internal addresses "
            "refused unless in `MEDIA_ALLOWED_HOSTS`.",
        ),
        (
            "video",
            f"{settings.VIDEO_MAX_DURATION_SECS:g} s (`VIDEO_MAX_DURATION_SECS`), "
            f"{settings.VIDEO_MAX_FRAMES} frames (`VIDEO_MAX_FRAMES`), "
            f"{settings.VIDEO_MAX_PIXELS_PER_FRAME} pixels a frame "
            "(`VIDEO_MAX_PIXELS_PER_FRAME`), decoded within "
            f"{settings.VIDEO_DECODE_DEADLINE_SECS:g} s (`VIDEO_DECODE_DEADLINE_SECS`).",
        ),
        (
            "tenant",
            "requests and prompt tokens per minute and concurrent requests, as an operator sets them: a "
            "429 with `Retry-After`; answers carry `x-ratelimit-*` headers where a tenant has per-minute "
            "limits.",
        ),
        (
            "queue",
            "while no worker can take a request it waits, at most "
            f"{settings.ROUTER_QUEUE_MAX_WAIT_SECS:g} s (`ROUTER_QUEUE_MAX_WAIT_SECS`), behind at most "
            f"{settings.ROUTER_QUEUE_MAX_DEPTH} others (`ROUTER_QUEUE_MAX_DEPTH`), "
            f"{settings.ROUTER_QUEUE_MAX_TENANT_DEPTH} of them its tenant's at its priority "
            "(`ROUTER_QUEUE_MAX_TENANT_DEPTH`); a streamed answer sends nothing until it has a worker.",
        ),
    ]


@only_get
def docs(request: HttpRequest) -> HttpResponse:
    """A readable page of the same document, rendered here (no script or style from elsewhere)."""
    document = current_document()
    operations = [
        {
            "method": method.upper(),
            "path": path,
            "summary": operation.get("summary", ""),
            "open": operation.get("security") == [],
            "statuses": sorted(operation["responses"]),
        }
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]
    chat_request = document["components"]["schemas"]["ChatCompletionRequest"]
    request_fields = chat_request["properties"]
    fields = [
        {
            "name": name,
            "type": spec.get("type", "one of several"),
            "description": inline_code(spec.get("description", "")),
        }
        for name, spec in request_fields.items()
    ]
    return render(
        request,
        "api/docs.html",
        {
            "document": document,
            "intro": inline_code(document["info"]["description"]),
            "request_note": inline_code(chat_request["description"]),
            "operations": operations,
            "fields": fields,
            "model": served_model().name,
            # The example's base URL is this server as the reader reached it (Host is checked
            # against ALLOWED_HOSTS before any view runs).
            "base_url": request.build_absolute_uri("/").rstrip("/"),
            "image_url": example_image_data_url(),
            "headers": [
                {"name": name, "description": inline_code(spec["description"])}
                for name, spec in _ROUTING_HEADERS.items()
            ],
            "errors": [
                {"status": status, "description": inline_code(response["description"])}
                for status, response in _ERRORS.items()
            ],
            "limits": [(inline_code(what), inline_code(bound)) for what, bound in _limits()],
        },
    )


def inline_code(text: str) -> SafeString:
    """The document's descriptions are CommonMark: their `code` spans as HTML, everything escaped."""
    return mark_safe(re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(text)))  # escaped first
