"""The HTTP side: a Starlette app with the OpenAI routes, served by uvicorn.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (JSON or server-sent events), ``GET /health``. Every
error is answered in OpenAI's shape ``{"error": {message, type, param, code}}``.
Handlers never touch the model: they queue a :class:`~.worker.Job` and relay
its events; a client that disconnects sets the job's ``cancel`` flag, so the
worker stops before its next decoding step.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .protocol import (
    OpenAIError,
    chunk_object,
    completion_object,
    new_id,
    parse_json,
    parse_request,
    sse,
)
from .worker import Job, Worker

log = logging.getLogger("mlx_mtp.server")

#: largest request body accepted (bytes)
MAX_BODY = 8 * 1024 * 1024


def error_response(e: OpenAIError) -> JSONResponse:
    """The JSON response of an :class:`OpenAIError`."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def create_app(worker: Worker, api_key: str | None = None) -> Starlette:
    """The ASGI app serving ``worker``'s model.

    Args:
        worker: a started :class:`~.worker.Worker`.
        api_key: if set, ``/v1/*`` requests need ``Authorization: Bearer <key>``
            (401 otherwise); ``/health`` stays open.
    """
    created = int(time.time())

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise OpenAIError(
                401,
                "Missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                "with the key given to `mlx-mtp serve --api-key`.",
                type="authentication_error",
                code="invalid_api_key",
            )

    def model_card() -> dict[str, Any]:
        return {
            "id": worker.model_id,
            "object": "model",
            "created": created,
            "owned_by": "mlx-mtp",
        }

    async def health(request: Request) -> Response:
        h = worker.health()
        return JSONResponse(h, status_code=200 if h["status"] == "ok" else 503)

    async def list_models(request: Request) -> Response:
        check_auth(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        check_auth(request)
        if request.path_params["model"] != worker.model_id:
            raise _unknown_model(request.path_params["model"], worker.model_id)
        return JSONResponse(model_card())

    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "chat")

    async def completions(request: Request) -> Response:
        return await _generate(request, "completion")

    async def _generate(request: Request, kind: str) -> Response:
        check_auth(request)
        declared = request.headers.get("content-length", "0")
        if declared.isdigit() and int(declared) > MAX_BODY:
            raise OpenAIError(413, f"The request body is over {MAX_BODY} bytes.")
        raw = await request.body()
        if len(raw) > MAX_BODY:
            raise OpenAIError(413, f"The request body is over {MAX_BODY} bytes.")
        req = parse_request(parse_json(raw), kind)
        if req.model != worker.model_id:
            raise _unknown_model(req.model, worker.model_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(req, emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev))
        worker.submit(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            first = await events.get()
            if first[0] == "error":
                raise first[1]
            if first[0] == "cancelled":
                raise _client_gone()
            if req.stream:
                return StreamingResponse(
                    _stream(job, events, first, watcher),
                    media_type="text/event-stream",
                    headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
                )
            return JSONResponse(await _collect(job, events, first))
        except BaseException:
            job.cancel.set()
            watcher.cancel()
            raise
        finally:
            if not req.stream:
                job.cancel.set()
                watcher.cancel()

    async def _collect(job: Job, events: asyncio.Queue, ev: tuple) -> dict[str, Any]:
        req, text = job.request, []
        while True:
            if ev[0] == "delta":
                text.append(ev[1])
            elif ev[0] == "error":
                raise ev[1]
            elif ev[0] == "cancelled":
                raise _client_gone()
            elif ev[0] == "done":
                _, finish, usage_, mtp = ev
                return completion_object(
                    req.kind, new_id(req.kind), req.model, "".join(text), finish, usage_, mtp
                )
            ev = await events.get()

    async def _stream(
        job: Job, events: asyncio.Queue, ev: tuple, watcher: asyncio.Task
    ) -> AsyncIterator[bytes]:
        req = job.request
        rid, stamp = new_id(req.kind), int(time.time())

        def chunk(**kw: Any) -> bytes:
            return sse(chunk_object(req.kind, rid, req.model, stamp, **kw))

        try:
            if req.kind == "chat":
                yield chunk(text="", role=True)
            while True:
                if ev[0] == "delta":
                    yield chunk(text=ev[1])
                elif ev[0] == "error":
                    yield sse(ev[1].body())
                    return
                elif ev[0] == "cancelled":
                    return
                elif ev[0] == "done":
                    _, finish, usage_, mtp = ev
                    if finish == "cancelled":
                        return
                    yield chunk(
                        text=None if req.kind == "chat" else "", finish_reason=finish, mtp=mtp
                    )
                    if req.include_usage:
                        yield chunk(usage_=usage_, mtp=mtp)
                    yield sse("[DONE]")
                    return
                ev = await events.get()
        finally:  # also when the client disconnected (the iterator is cancelled)
            job.cancel.set()
            watcher.cancel()

    async def on_openai_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, OpenAIError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(
            OpenAIError(
                exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code
            )
        )

    async def on_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(OpenAIError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    return Starlette(
        routes=[
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", list_models, methods=["GET"]),
            Route("/v1/models/{model:path}", get_model, methods=["GET"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
        ],
        exception_handlers={
            OpenAIError: on_openai_error,
            HTTPException: on_http_error,
            Exception: on_error,
        },
    )


def _client_gone() -> OpenAIError:
    # 499 "client closed request" (nginx's code): nobody reads it, the client is gone
    return OpenAIError(499, "The client disconnected; the request was cancelled.")


def _unknown_model(asked: str, served: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model {asked!r} is not served here; this server serves {served!r} "
        "(see GET /v1/models). Choose the decoding method with the 'mtp' field, e.g. "
        '{"mtp": {"method": "pld"}}.',
        param="model",
        code="model_not_found",
    )


async def _watch_disconnect(request: Request, job: Job) -> None:
    """Set ``job.cancel`` when the client disconnects (the body is already read,
    so the next ASGI message is ``http.disconnect``)."""
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                job.cancel.set()
                return
    except (asyncio.CancelledError, RuntimeError, OSError):
        return


def make_server(
    worker: Worker,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    log_level: str = "info",
) -> Any:
    """A ``uvicorn.Server`` for the app (call ``.run()``; ``.should_exit = True`` stops it)."""
    import uvicorn

    config = uvicorn.Config(
        create_app(worker, api_key),
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=5,
    )
    return uvicorn.Server(config)
