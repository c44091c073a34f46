"""The OpenAPI 3 description of the public API, served at `/v1/openapi.json`, and its docs page.

Written by hand (the views are async Django views, which drf-spectacular cannot introspect) and
checked twice by the suite: `openapi-spec-validator` validates the document, and schemathesis
sends hundreds of generated requests to a live server and validates every answer against it.
Bounds that depend on the deployment (the served model, `MAX_TOKENS_LIMIT`) are filled in from
settings, so the document always says what this server accepts.
"""

from __future__ import annotations

import re
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

from inference_platform.api.boundary import only_get
from inference_platform.api.chat_request import (
    MAX_CACHE_SALT_LENGTH,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_SEQUENCES,
    MAX_TOP_LOGPROBS,
)
from inference_platform.serving.prepare import served_model

_JSON = "application/json"


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _error_response(description: str, headers: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {"description": description, "content": {_JSON: {"schema": _ref("Error")}}}
    if headers:
        response["headers"] = headers
    return response


_ERRORS = {
    "400": _error_response(
        "The request is invalid; `error.param` names the field (also `unsupported_parameter`)."
    ),
    "401": _error_response("Missing, wrong, revoked or expired API key."),
    "403": _error_response("An image URL the platform refuses to fetch (an internal address, say)."),
    "404": _error_response("Unknown model."),
    "413": _error_response("The body is over the size limit."),
    "415": _error_response("The body is not application/json."),
    "422": _error_response("An image the model cannot take (size)."),
    "429": _error_response(
        "Over one of the tenant's limits (requests or prompt tokens per minute, concurrent requests).",
        {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}},
    ),
    "502": _error_response("The worker failed or stopped while answering."),
    "503": _error_response("No live worker, or the platform's shared state is unavailable."),
    "504": _error_response("The worker did not answer in time."),
}

_ROUTING_HEADERS = {
    "X-Request-Id": {"description": "The request's id (also in the answer).", "schema": {"type": "string"}},
    "X-Routed-Worker": {"description": "The worker that served the request.", "schema": {"type": "string"}},
    "X-Routing-Overlap": {
        "description": "Cached prefix blocks of the chosen worker / the prompt's blocks, in the caller's "
        "own cache partition.",
        "schema": {"type": "string", "pattern": r"^\d+/\d+$"},
    },
}


def _schemas(model_name: str, max_tokens_limit: int) -> dict[str, Any]:
    nullable_string = {"type": "string", "nullable": True}
    text_part = {
        "type": "object",
        "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}},
    }
    image_part = {
        "type": "object",
        "required": ["type", "image_url"],
        "properties": {
            "type": {"type": "string", "enum": ["image_url"]},
            "image_url": {
                "type": "object",
                "required": ["url"],
                "properties": {
                    "url": {
                        "type": "string",
                        "minLength": 1,
                        "description": "An http(s) URL or a data:image/...;base64 URL.",
                    },
                    "detail": {"type": "string", "enum": ["auto", "low", "high"]},
                },
            },
        },
    }
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
    return {
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
        "Message": {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"type": "string", "enum": ["system", "developer", "user", "assistant"]},
                "content": {
                    "oneOf": [
                        {"type": "string"},
                        {"type": "array", "items": {"oneOf": [_ref("TextPart"), _ref("ImagePart")]}},
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
                "max_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens_limit},
                "max_completion_tokens": {"type": "integer", "minimum": 1, "maximum": max_tokens_limit},
                "temperature": {"type": "number", "minimum": 0, "maximum": 2},
                "top_p": {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1},
                "seed": {"type": "integer", "minimum": 0},
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
                "cache_salt": {
                    "type": "string",
                    "minLength": 1,
                    "maxLength": MAX_CACHE_SALT_LENGTH,
                    "description": "Narrows the caller's cache partition further (as vLLM's `cache_salt`).",
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
                "reason": {"type": "string"},
            },
        },
    }


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
        },
    )


def inline_code(text: str) -> SafeString:
    """The document's descriptions are CommonMark: their `code` spans as HTML, everything escaped."""
    return mark_safe(re.sub(r"`([^`]+)`", r"<code>\1</code>", escape(text)))  # escaped first
