"""The OpenAI-compatible REST API: `/v1/chat/completions`, `/v1/models` and the operators' `/v1/route`.

Every view here runs for an authenticated caller (`api_key_required`): the caller's tenant
bounds what its requests may use (limits) and see (its own cache partition)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import redis
from django.conf import settings
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt

from inference_platform.api.auth import api_key_required
from inference_platform.api.boundary import is_api_path, json_endpoint, new_request_id, only_get
from inference_platform.api.chat_request import ChatRequest, parse_chat_request
from inference_platform.api.errors import ApiError, error_response
from inference_platform.serving.clock import RequestClock
from inference_platform.serving.dispatch import Dispatch, follow, request_cancel, state_unavailable
from inference_platform.serving.prepare import describe_route, finish_request, plan_request, served_model
from routing.contract.responses import ResponseEvent
from routing.contract.tasks import IMAGE_CHANGED, DoneEvent, ErrorEvent, TokenEvent
from routing.prompt.model_view import ModelView
from tenants.keys import Caller

logger = logging.getLogger("inference_platform.api")

# nginx's code for a client that closed the connection before the answer: counted, never sent.
CLIENT_CLOSED = 499


def _model_card(view: ModelView) -> dict[str, Any]:
    created = int(view.path.stat().st_mtime) if view.path.exists() else 0
    return {"id": view.name, "object": "model", "created": created, "owned_by": "platform"}


@api_key_required
@only_get
def list_models(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"object": "list", "data": [_model_card(served_model())]})


@csrf_exempt
@api_key_required
def retrieve_model(request: HttpRequest, model_id: str) -> HttpResponse:
    if request.method not in ("GET", "HEAD"):
        response = error_response(
            ApiError(405, f"Use GET for {request.path}.", code="method_not_allowed"), new_request_id()
        )
        response["Allow"] = "GET, HEAD"
        return response
    view = served_model()
    if model_id != view.name:
        return error_response(
            ApiError(
                404,
                f"The model '{model_id}' does not exist; this platform serves '{view.name}'.",
                code="model_not_found",
                param="model",
            )
        )
    return JsonResponse(_model_card(view))


def _headers(response: HttpResponse, dispatch: Dispatch) -> HttpResponse:
    response["X-Request-Id"] = dispatch.request_id
    response["X-Routed-Worker"] = dispatch.worker
    if dispatch.total_blocks:
        response["X-Routing-Overlap"] = f"{dispatch.overlap_blocks}/{dispatch.total_blocks}"
    return response


def _usage(done: DoneEvent) -> dict[str, Any]:
    prompt, completion = int(done.prompt_tokens), int(done.completion_tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": int(done.cached_tokens)},
    }


def _worker_error(error: ErrorEvent, dispatch: Dispatch) -> ApiError:
    if error.code == IMAGE_CHANGED and dispatch.forget_image_sizes is not None:
        dispatch.forget_image_sizes()
    status = int(error.status)
    message = error.message or "The worker failed."
    if status >= 500:
        message = f"{message} (request {dispatch.request_id}, worker {dispatch.worker})"
    return ApiError(status, message, code=error.code or "worker_error", param=error.param)


@api_key_required
@json_endpoint
async def chat_completions(request: HttpRequest, body: dict[str, Any], request_id: str) -> HttpResponse:
    clock = RequestClock()
    caller: Caller = request.caller
    try:
        chat = parse_chat_request(body, max_tokens_limit=settings.MAX_TOKENS_LIMIT)
        dispatch = await plan_request(chat, request_id, dict(request.headers), caller)
    except Exception as exc:
        error = _api_error(exc, request_id)
        clock.finish(error.status, None)
        return error_response(error, request_id)

    if chat.stream:
        return await _start_stream(chat, dispatch, clock, caller)

    text: list[str] = []
    done: DoneEvent | None = None
    try:
        async for entry in follow(dispatch):
            event = entry.event
            if isinstance(event, TokenEvent):
                clock.first_token()
                text.append(event.text)
            elif isinstance(event, ErrorEvent):
                raise _worker_error(event, dispatch)
            elif isinstance(event, DoneEvent):
                done = event
    except asyncio.CancelledError:
        clock.finish(CLIENT_CLOSED, dispatch.worker)
        await _cancel_quietly(request_id)
        raise
    except Exception as exc:
        # Anything follow() did not turn into an ApiError still answers in the API's format with
        # the request id (a lost Redis a 503), never Django's bare 500.
        error = _api_error(exc, request_id)
        clock.finish(error.status, dispatch.worker)
        return _headers(error_response(error, request_id), dispatch)
    finally:
        await finish_request(caller, request_id, done)
    if done is None:  # the stream ended without an answer: follow() should have raised
        error = ApiError(502, f"Request {request_id} ended without an answer.", code="worker_error")
        return _headers(error_response(error, request_id), dispatch)
    clock.finish(200, dispatch.worker, done)
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
    response = _headers(JsonResponse(body), dispatch)
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
        return error_response(_api_error(exc, request_id), request_id)
    response = JsonResponse(description)
    response["X-Request-Id"] = request_id
    return response


async def _cancel_quietly(request_id: str) -> None:
    """Ask the worker to stop a request whose client went away; with Redis gone too, the worker
    finishes it and its stream expires."""
    try:
        await request_cancel(request_id)
    except redis.RedisError:
        logger.warning("could not cancel request %s: Redis failed", request_id)


def _api_error(exc: Exception, request_id: str) -> ApiError:
    """What a failure answers: an ApiError as it is; anything unforeseen still in the API's
    format, with the request id (a lost Redis a 503, the rest a logged 500)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, redis.RedisError):
        return state_unavailable(request_id, exc)
    logger.exception("request %s failed", request_id)
    return ApiError(500, f"Internal error in request {request_id}.", code="internal_error")


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


async def _start_stream(
    chat: ChatRequest, dispatch: Dispatch, clock: RequestClock, caller: Caller
) -> HttpResponse:
    """A streamed answer, whose status line waits for the worker's first answer (its first token,
    its end, or its error): a failure before it is a real status a client can act on (a 4xx of
    the request's, a 502/503/504 of a worker's, which clients retry), not a 200 with an error
    inside, and X-Routed-Worker names the worker that answered after a migration or a replan.
    A failure after it ends the stream with the error as its last event."""
    rid = dispatch.request_id
    events = follow(dispatch)
    try:
        first = await anext(events, None)
        while first is not None and not isinstance(first.event, (TokenEvent, ErrorEvent, DoneEvent)):
            first = await anext(events, None)
        if first is None:  # follow() should have raised
            raise ApiError(502, f"Request {rid} ended without an answer.", code="worker_error")
        if isinstance(first.event, ErrorEvent):
            await events.aclose()  # frees the lease now, as the end of the stream would
            raise _worker_error(first.event, dispatch)
        if isinstance(first.event, TokenEvent):
            clock.first_token()  # now, not when the server starts sending the response
    except asyncio.CancelledError:
        clock.finish(CLIENT_CLOSED, dispatch.worker)
        await _cancel_quietly(rid)
        await finish_request(caller, rid, None)
        raise
    except Exception as exc:
        error = _api_error(exc, rid)
        clock.finish(error.status, dispatch.worker)
        await finish_request(caller, rid, None)
        return _headers(error_response(error, rid), dispatch)
    response = StreamingHttpResponse(
        _stream(chat, dispatch, clock, caller, first, events), content_type="text/event-stream"
    )
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    return _headers(response, dispatch)


async def _stream(
    chat: ChatRequest,
    dispatch: Dispatch,
    clock: RequestClock,
    caller: Caller,
    first: ResponseEvent,
    events: AsyncIterator[ResponseEvent],
) -> AsyncIterator[bytes]:
    """The chunks of a stream whose first answer `first` came from `events` (`_start_stream`)."""
    rid = dispatch.request_id
    finished = False
    done: DoneEvent | None = None
    logprobs_streamed = 0
    try:
        yield _chunk(rid, chat.model, {"role": "assistant", "content": ""})
        entry: ResponseEvent | None = first
        while entry is not None:
            event = entry.event
            if isinstance(event, TokenEvent):
                clock.first_token()
                logprobs_streamed += len(event.logprobs or ())
                yield _chunk(
                    rid, chat.model, {"content": event.text}, None, _streamed_logprobs(chat, event.logprobs)
                )
            elif isinstance(event, ErrorEvent):
                raise _worker_error(event, dispatch)
            elif isinstance(event, DoneEvent):
                done = event
                clock.finish(200, dispatch.worker, event)
                remaining = _remaining_logprobs(chat, event, logprobs_streamed)
                yield _chunk(rid, chat.model, {}, event.finish_reason, remaining)
                if chat.include_usage:
                    yield _event(rid, chat.model, [], usage=_usage(event))
            entry = await anext(events, None)
        finished = True
    except Exception as exc:
        # The status line already said 200; the metric records what the client really got.
        error = _api_error(exc, rid)
        clock.finish(error.status, dispatch.worker)
        logger.warning("stream %s failed with %s: %s", rid, error.status, error.message)
        yield f"data: {json.dumps(error.body())}\n\n".encode()
        finished = True
    finally:
        if not finished:  # the client went away mid-stream
            clock.finish(CLIENT_CLOSED, dispatch.worker)
            await _cancel_quietly(rid)
        await finish_request(caller, rid, done)
    yield b"data: [DONE]\n\n"


def not_found(request: HttpRequest, exception: Exception | None = None) -> HttpResponse:
    """API clients get OpenAI-style JSON for unknown paths; everyone else Django's page."""
    if is_api_path(request.path):
        return error_response(
            ApiError(404, f"No route for {request.method} {request.path}.", code="not_found")
        )
    from django.views.defaults import page_not_found

    return page_not_found(request, exception)


def server_error(request: HttpRequest) -> HttpResponse:
    """An unforeseen failure outside a view's own handling: API clients still get JSON."""
    if is_api_path(request.path):
        return error_response(ApiError(500, "Internal error.", code="internal_error"))
    from django.views.defaults import server_error as html_server_error

    return html_server_error(request)
