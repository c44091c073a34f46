"""The OpenAI-compatible REST API: `/v1/chat/completions`, `/v1/models` and the operators' `/v1/route`.

Every view here runs for an authenticated caller (`api_key_required`): the caller's tenant
bounds what its requests may use (limits) and see (its own cache partition)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from inference_platform.api.auth import api_key_required
from inference_platform.api.boundary import is_api_path, json_endpoint, new_request_id, only_get
from inference_platform.api.chat_request import ChatRequest, parse_chat_request
from inference_platform.api.errors import ApiError, error_response
from inference_platform.serving.catalog import ListedModel, listed_models
from inference_platform.serving.clock import counts_refused_chat_requests
from inference_platform.serving.model_pool import model_not_found
from inference_platform.serving.prepare import describe_route, served_model
from inference_platform.serving.served import ServedRequest, as_api_error
from routing.contract.tasks import DoneEvent, TokenEvent

logger = logging.getLogger("inference_platform.api")


def _model_card(model: ListedModel) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": "platform"}


@api_key_required
@only_get
def list_models(request: HttpRequest) -> HttpResponse:
    return JsonResponse(
        {"object": "list", "data": [_model_card(model) for model in listed_models(request.caller)]}
    )


@csrf_exempt
@api_key_required
def retrieve_model(request: HttpRequest, model_id: str) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        response = error_response(
            ApiError(405, f"Use GET for {request.path}.", code="method_not_allowed"), new_request_id()
        )
        response["Allow"] = "GET, HEAD"
        return response
    for model in listed_models(request.caller):
        if model.name == model_id:
            return JsonResponse(_model_card(model))
    return error_response(model_not_found(model_id))


def _headers(response: HttpResponse, served: ServedRequest) -> HttpResponse:
    response["X-Request-Id"] = served.request_id
    if served.worker is not None:
        response["X-Routed-Worker"] = served.worker
    if served.prepared is not None:  # the model that answered (an alias names one of several)
        response["X-Served-Model"] = served.prepared.model.name
    if served.total_blocks:
        response["X-Routing-Overlap"] = f"{served.overlap_blocks}/{served.total_blocks}"
    for name, value in served.rate_limit_headers.items():
        response[name] = value
    return response


def _usage(done: DoneEvent) -> dict[str, Any]:
    prompt, completion = int(done.prompt_tokens), int(done.completion_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(done.cached_tokens)},
    }


@counts_refused_chat_requests
@api_key_required
@json_endpoint
async def chat_completions(request: HttpRequest, body: dict[str, Any], request_id: str) -> HttpResponse:
    served = ServedRequest(request_id, request.caller)
    # The request's own clock counts it from here; the decorator counts only the refusals before.
    request.request_clock = served.clock
    try:
        chat = parse_chat_request(body, max_tokens_limit=settings.MAX_TOKENS_LIMIT)
        await served.open(chat, dict(request.headers))
    except Exception as exc:
        return error_response(await served.fail(exc), request_id)

    if chat.stream:
        return await _start_stream(chat, served)

    text: list[str] = []
    done: DoneEvent | None = None
    try:
        async for event in served.events():
            if isinstance(event, TokenEvent):
                text.append(event.text)
            else:
                done = event
    except ApiError as error:
        return _headers(error_response(error, request_id), served)
    assert done is not None  # events() ends with the answer or raises
    body = {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": chat.model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": done.text or "".join(text)},
                "logprobs": _logprobs(chat, done),
                "finish_reason": done.finish_reason,
            }
        ],
        "usage": _usage(done),
    }
    response = _headers(JsonResponse(body), served)
    # How often the worker ran its vision encoder for this request (0: every image and video came
    # from its cached prefix or its embedding cache).
    response["X-Encoder-Calls"] = str(int(done.encoder_calls))
    return response


@api_key_required(operator=True)
@json_endpoint
async def route(request: HttpRequest, body: dict[str, Any], request_id: str) -> HttpResponse:
    """What the router sees of a chat request, without dispatching it (operators only), in the
    caller's own cache partition."""
    try:
        body.setdefault("model", served_model().name)
        chat = parse_chat_request(body, max_tokens_limit=settings.MAX_TOKENS_LIMIT)
        description = await describe_route(chat, dict(request.headers), request.caller)
    except Exception as exc:
        return error_response(as_api_error(exc, request_id), request_id)
    response = JsonResponse(description)
    response["X-Request-Id"] = request_id
    return response


def _logprobs(chat: ChatRequest, done: DoneEvent) -> dict[str, Any] | None:
    """OpenAI's `choices[0].logprobs` when the request asked for them."""
    if not chat.logprobs:
        return None
    return {"content": [] if done.logprobs is None else list(done.logprobs)}


def _streamed_logprobs(chat: ChatRequest, entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A streamed chunk's `choices[0].logprobs`: its own tokens' entries, when the request asked
    for them and the chunk carries any (null otherwise, as OpenAI sends)."""
    if not chat.logprobs or not entries:
        return None
    return {"content": list(entries)}


def _remaining_logprobs(chat: ChatRequest, done: DoneEvent, streamed: int) -> dict[str, Any] | None:
    """The last chunk's `logprobs`: the entries of tokens no content chunk carried (a stop
    string's, or all of them from a worker that does not stream them), else null."""
    return _streamed_logprobs(chat, (done.logprobs or [])[streamed:])


def _chunk(
    request_id: str,
    model: str,
    delta: dict[str, Any],
    finish_reason: str | None = None,
    logprobs: dict[str, Any] | None = None,
) -> bytes:
    return _event(
        request_id,
        model,
        [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}],
    )


def _event(request_id: str, model: str, choices: list[dict[str, Any]], **extra: Any) -> bytes:
    """One server-sent event carrying a `chat.completion.chunk`."""
    payload = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        **extra,
    }
    return f"data: {json.dumps(payload)}\n\n".encode()


async def _start_stream(chat: ChatRequest, served: ServedRequest) -> HttpResponse:
    """A streamed answer, whose status line waits for the worker's first answer (its first token,
    or its end): a failure before it is a real status a client can act on (a 4xx of the
    request's, a 502/503/504 of a worker's, which clients retry), not a 200 with an error inside,
    and X-Routed-Worker names the worker that answered after a migration or a replan. A failure
    after it ends the stream with the error as its last event."""
    events = served.events()
    try:
        first = await anext(events)
    except ApiError as error:
        return _headers(error_response(error, served.request_id), served)
    response = _ClosingStream(_stream(chat, served, first, events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return _headers(response, served)


class _ClosingStream(StreamingHttpResponse):
    """An event stream whose generator is closed when Django stops sending it.

    Django reads an async response's content through two generators of its own and, when the
    client goes away while a piece is being sent (the send cancelled), closes only the outer
    one: the content itself stayed suspended until garbage collection, and the request ran on
    at its worker to its last token. Closing `_stream` closes the request's events, which
    cancels it (`ServedRequest.events`)."""

    async def __aiter__(self):
        async with aclosing(self._iterator) as parts:
            async for part in parts:
                yield self.make_bytes(part)


async def _stream(
    chat: ChatRequest,
    served: ServedRequest,
    first: TokenEvent | DoneEvent,
    events: AsyncGenerator[TokenEvent | DoneEvent, None],
) -> AsyncIterator[bytes]:
    """The chunks of a stream whose first answer `first` came from `events` (`_start_stream`).
    A client that goes away closes this generator, which closes `events`: that cancels the
    request (`ServedRequest.events`)."""
    rid = served.request_id
    logprobs_streamed = 0
    try:
        yield _chunk(rid, chat.model, {"role": "assistant", "content": ""})
        event: TokenEvent | DoneEvent | None = first
        while event is not None:
            if isinstance(event, TokenEvent):
                logprobs_streamed += len(event.logprobs or ())
                yield _chunk(
                    rid, chat.model, {"content": event.text}, None, _streamed_logprobs(chat, event.logprobs)
                )
            else:
                remaining = _remaining_logprobs(chat, event, logprobs_streamed)
                yield _chunk(rid, chat.model, {}, event.finish_reason, remaining)
                if chat.include_usage:
                    yield _event(rid, chat.model, [], usage=_usage(event))
            event = await anext(events, None)
    except ApiError as error:
        # The status line already said 200: the stream's last event says what went wrong.
        logger.warning("stream %s failed with %s: %s", rid, error.status, error.message)
        yield f"data: {json.dumps(error.body())}\n\n".encode()
    finally:
        await events.aclose()  # a no-op once it ended; else the client went away: cancel
    yield b"data: [DONE]\n\n"


# OpenAI endpoints a client may try first (a completions-era SDK, a RAG pipeline's embedder).
_OPENAI_NOT_SERVED = {
    "/v1/completions": "legacy text completions",
    "/v1/embeddings": "embeddings",
    "/v1/responses": "the Responses API",
}
_SERVED = "POST /v1/chat/completions, GET /v1/models and GET /v1/models/{id} (see /v1/docs)"


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """API clients get OpenAI-style JSON for unknown paths; everyone else Django's page."""
    if is_api_path(request.path):
        what = _OPENAI_NOT_SERVED.get(request.path.rstrip("/"))
        if what is not None:
            message = (
                f"{request.path} ({what}) is not served here: this server serves /v1/chat/completions "
                f"(send the prompt as messages there). Its endpoints: {_SERVED}."
            )
        else:
            message = f"No route for {request.method} {request.path}. This server's endpoints: {_SERVED}."
        return error_response(ApiError(404, message, code="not_found"))
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """An unforeseen failure outside a view's own handling: API clients still get JSON."""
    if is_api_path(request.path):
        return error_response(ApiError(500, "Internal error.", code="internal_error"))
    from django.views.defaults import server_error as html_server_error

    return html_server_error(request)
