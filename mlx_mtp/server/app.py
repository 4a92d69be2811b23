"""The HTTP side: a Starlette app with the OpenAI routes, served by uvicorn.

Routes: ``GET /v1/models``, ``GET /v1/models/{id}``, ``POST /v1/chat/completions``,
``POST /v1/completions`` (JSON or server-sent events), ``GET /health``. Every
error is answered in OpenAI's shape ``{"error": {message, type, param, code}}``.
Handlers never touch the model: they queue a :class:`~.worker.Job` and relay
its :mod:`~.events`; a client that disconnects, or whose job waited longer
than the queue timeout, sets the job's ``cancel`` flag, so the worker stops
before its next forward pass.

Hostile or slow clients: a body is read within ``--client-timeout`` (else
408) and up to :data:`MAX_BODY` bytes (else 413, after reading the rest so
that the client is not reset while sending); a client that leaves during its
upload is dropped without a traceback; a connection that has not sent full
headers within ``--client-timeout`` is closed (:func:`_timed_h11`). On
shutdown the app stops its jobs (``shut_down``), so open streams end with a
``"cancelled"`` chunk and ``[DONE]`` within one forward pass.

Browser safety (:class:`BrowserGuard`): a web page the user visits can send
requests to ``127.0.0.1``, and with DNS rebinding read the answers. So the
``Host`` header must name this server (the bound address, the localhost
names, or ``--allow-host`` names), a request with an ``Origin`` header must
come from an ``--allow-origin`` origin (none by default), and POST bodies
must be ``application/json`` (a cross-origin ``text/plain`` POST needs no
CORS preflight in a browser).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import math
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterable
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import InvalidArgumentError
from .events import Cancelled, Delta, Done, Event, Failed, Taken
from .protocol import (
    OpenAIError,
    chat_logprobs,
    chunk_object,
    completion_logprobs,
    completion_object,
    new_id,
    parse_json,
    parse_request,
    sse,
)
from .tools import ToolCallStream, finish_reason
from .worker import Job, Worker

log = logging.getLogger("mlx_mtp.server")

#: largest request body accepted (bytes)
MAX_BODY = 8 * 1024 * 1024
#: most bytes of a body over :data:`MAX_BODY` read (and dropped) before the 413
MAX_DRAIN = 64 * 1024 * 1024
#: default seconds a request may wait in the queue before a 503
QUEUE_TIMEOUT = 300.0
#: default seconds a client has to send a request's headers, and then its body
CLIENT_TIMEOUT = 30.0
#: host names that always mean this machine
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: addresses that bind every interface
WILDCARD = frozenset({"0.0.0.0", "::", ""})


def error_response(e: OpenAIError, headers: dict[str, str] | None = None) -> JSONResponse:
    """The JSON response of an :class:`OpenAIError`."""
    return JSONResponse(e.body(), status_code=e.status, headers={**e.headers, **(headers or {})})


def host_of(header: str) -> str:
    """The host name of a ``Host`` header value, lower case, without the port,
    brackets or a trailing dot (``[::1]:8080`` -> ``::1``)."""
    h = header.strip().lower()
    if h.startswith("["):
        h = h[1 : h.find("]")] if "]" in h else h[1:]
    elif h.count(":") == 1:
        h = h.split(":", 1)[0]
    return h.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class BrowserGuard:
    """ASGI middleware: refuse requests a web page could have sent (see the
    module doc) before any route runs.

    Args:
        app: the ASGI app to guard.
        hosts: accepted ``Host`` names (lower case); with ``any_ip`` also any
            IP address literal (a wildcard bind: DNS rebinding needs a name).
        origins: ``Origin`` values allowed to call (``*``: any); they get
            CORS headers and preflight answers. Requests without ``Origin``
            (curl, SDKs, editors) pass.
    """

    def __init__(self, app: Any, hosts: Iterable[str], origins: Iterable[str], any_ip: bool):
        self.app = app
        self.hosts = frozenset(h.lower() for h in hosts)
        self.origins = frozenset(o.rstrip("/") for o in origins)
        self.any_ip = any_ip

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        host = host_of(headers.get("host", ""))
        if not host or not (host in self.hosts or (self.any_ip and _is_ip(host))):
            err = OpenAIError(
                400,
                f"The Host header {headers.get('host', '')!r} does not name this server. A "
                "client on this machine should use http://127.0.0.1:PORT; other names must be "
                "allowed with `mlx-mtp serve --allow-host NAME`.",
                code="host_not_allowed",
            )
            await error_response(err)(scope, receive, send)
            return
        origin = headers.get("origin")
        if origin is None:
            await self.app(scope, receive, send)
            return
        if "*" not in self.origins and origin.rstrip("/") not in self.origins:
            err = OpenAIError(
                403,
                f"Requests from the web origin {origin!r} are refused (a page in a browser "
                "cannot drive this server). Allow it with `mlx-mtp serve --allow-origin "
                "ORIGIN`.",
                code="origin_not_allowed",
            )
            await error_response(err)(scope, receive, send)
            return
        cors = {
            "Access-Control-Allow-Origin": origin,
            "Vary": "Origin",
            "Access-Control-Allow-Headers": "Authorization, Content-Type",
            "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
            "Access-Control-Max-Age": "600",
        }
        if scope["method"] == "OPTIONS" and "access-control-request-method" in headers:
            await Response(status_code=204, headers=cors)(scope, receive, send)
            return

        async def send_with_cors(message: dict) -> None:
            if message["type"] == "http.response.start":
                extra = [(k.lower().encode(), v.encode()) for k, v in cors.items()]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, send_with_cors)


def create_app(
    worker: Worker,
    api_key: str | None = None,
    *,
    hosts: Iterable[str] = LOCAL_NAMES,
    any_ip: bool = False,
    origins: Iterable[str] = (),
    queue_timeout: float = QUEUE_TIMEOUT,
    client_timeout: float = CLIENT_TIMEOUT,
) -> Any:
    """The ASGI app serving ``worker``'s model, behind a :class:`BrowserGuard`.

    The returned app has a ``shut_down()`` method: it stops every job the app
    runs or has queued (their streams end with a ``"cancelled"`` chunk and
    ``[DONE]``) and refuses new ones (503); the server calls it when it
    begins to shut down.

    Args:
        worker: a started :class:`~.worker.Worker`.
        api_key: if set, ``/v1/*`` requests need ``Authorization: Bearer <key>``
            (401 otherwise), and ``/health`` says only whether the server is
            alive unless the request carries the key.
        hosts / any_ip / origins: see :class:`BrowserGuard`.
        queue_timeout: seconds a request may wait for the worker before it is
            answered 503 ``queue_timeout`` (and dropped from the queue).
        client_timeout: seconds a client has to send a request's body once
            its headers have come (then 408, and the connection is closed).
    """
    created = int(time.time())
    live: set[Job] = set()  # the jobs of requests being answered
    stopping = asyncio.Event()  # set at shutdown: new requests are refused

    def shut_down() -> int:
        """Stop every job this app runs or has queued (at server shutdown):
        the worker ends each before its next forward pass, and open streams
        get a final chunk (``finish_reason: "cancelled"``) and ``[DONE]``.
        Returns how many jobs were told."""
        stopping.set()
        for job in live:
            job.shutdown = True
            job.cancel.set()
        return len(live)

    def authorized(request: Request) -> bool:
        if api_key is None:
            return True
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        )

    def check_auth(request: Request) -> None:
        if not authorized(request):
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
        code = 200 if h["status"] == "ok" else 503
        if not authorized(request):  # a key is set: say only whether it is alive
            return JSONResponse({"status": h["status"]}, status_code=code)
        return JSONResponse(h, status_code=code)

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
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json":
            raise OpenAIError(
                415,
                f"The request body must be JSON sent with 'Content-Type: application/json' "
                f"(got {media or 'no Content-Type'!r}).",
                code="unsupported_media_type",
            )
        body = await _read_body(request, client_timeout)
        if body is None:  # the client left during the upload: nobody to answer
            return Response(status_code=400)
        req = parse_request(parse_json(body), kind)
        if req.model != worker.model_id:
            raise _unknown_model(req.model, worker.model_id)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()
        prepared = worker.admit(req)  # a bad request is a 400 now, never a 429 first
        job = Job(
            req,
            emit=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev),
            prepared=prepared,
        )
        if stopping.is_set():
            raise _shutting_down()
        worker.submit(job)
        live.add(job)
        watcher = asyncio.create_task(_watch_disconnect(request, job))
        try:
            first = await _first_event(job, events)
            if isinstance(first, Failed):
                raise first.error
            if isinstance(first, Cancelled):
                raise _shutting_down() if job.shutdown else _client_gone()
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
            live.discard(job)
            raise
        finally:
            if not req.stream:
                job.cancel.set()
                watcher.cancel()
                live.discard(job)

    async def _first_event(job: Job, events: asyncio.Queue[Event]) -> Event:
        """The first event after the worker took the job (its queue wait
        bounded by ``queue_timeout``)."""
        deadline = time.monotonic() + queue_timeout
        while True:
            left = deadline - time.monotonic()
            try:
                ev = await asyncio.wait_for(events.get(), timeout=max(left, 0.0))
            except asyncio.TimeoutError:
                job.cancel.set()  # the worker skips it when it comes to it
                raise OpenAIError(
                    503,
                    f"The request waited {queue_timeout:g} s in the queue without being "
                    "served (--queue-timeout); retry later.",
                    type="server_error",
                    code="queue_timeout",
                    headers={"Retry-After": str(worker.retry_after())},
                ) from None
            if isinstance(ev, Taken):
                return await events.get()
            return ev  # Failed (shutting down) or Cancelled before the worker took it

    def tool_stream(req: Any, streaming: bool) -> ToolCallStream | None:
        if req.tools is None:
            return None
        return ToolCallStream(worker.loaded.tokenizer, req.tools, streaming)

    def logprobs_object(req: Any, entries: list[dict[str, Any]], offset: int) -> dict[str, Any]:
        if req.kind == "chat":
            return chat_logprobs(entries)
        return completion_logprobs(entries, offset)

    async def _collect(job: Job, events: asyncio.Queue[Event], ev: Event) -> dict[str, Any]:
        req, text, calls, entries = job.request, [], [], []
        tools = tool_stream(req, streaming=False)
        while True:
            if isinstance(ev, Delta):
                content, made = tools.feed(ev.text) if tools is not None else (ev.text, [])
                text.append(content)
                calls += made
                entries += ev.logprobs or []
            elif isinstance(ev, Failed):
                raise ev.error
            elif isinstance(ev, Cancelled):
                raise _client_gone()
            elif isinstance(ev, Done):
                if tools is not None:
                    content, made = tools.finish()
                    text.append(content)
                    calls += made
                return completion_object(
                    req.kind,
                    new_id(req.kind),
                    req.model,
                    "".join(text),
                    finish_reason(ev.finish_reason, tools),
                    ev.usage,
                    ev.mtp,
                    tool_calls=calls,
                    logprobs=None if req.logprobs is None else logprobs_object(req, entries, 0),
                )
            ev = await events.get()

    async def _stream(
        job: Job, events: asyncio.Queue[Event], ev: Event, watcher: asyncio.Task
    ) -> AsyncIterator[bytes]:
        req = job.request
        rid, stamp = new_id(req.kind), int(time.time())

        def chunk(**kw: Any) -> bytes:
            return sse(chunk_object(req.kind, rid, req.model, stamp, **kw))

        tools = tool_stream(req, streaming=True)
        sent = 0  # characters of the answer sent (a completion's text_offset)

        def piece(text: str, calls: list[dict[str, Any]], entries: Any, **kw: Any) -> bytes:
            nonlocal sent
            lp = None if entries is None else logprobs_object(req, entries, sent)
            sent += len(text)
            return chunk(text=text, tool_calls=calls or None, logprobs=lp, **kw)

        try:
            if req.kind == "chat":
                yield chunk(text="", role=True)
            while True:
                if isinstance(ev, Delta):
                    text, calls = tools.feed(ev.text) if tools is not None else (ev.text, [])
                    if text or calls or ev.logprobs:
                        yield piece(text, calls, ev.logprobs)
                elif isinstance(ev, Failed):
                    yield sse(ev.error.body())
                    return
                elif isinstance(ev, Cancelled):
                    return
                elif isinstance(ev, Done):
                    if ev.finish_reason == "cancelled" and not job.shutdown:
                        return  # the client has gone: nobody reads an end
                    if tools is not None:
                        text, calls = tools.finish()
                        if text or calls:
                            yield piece(text, calls, None)
                    yield chunk(
                        text=None if req.kind == "chat" else "",
                        finish_reason=finish_reason(ev.finish_reason, tools),
                        mtp=ev.mtp,
                    )
                    if req.include_usage:
                        yield chunk(usage_=ev.usage, mtp=ev.mtp)
                    yield sse("[DONE]")
                    return
                ev = await events.get()
        finally:  # also when the client disconnected (the iterator is cancelled)
            job.cancel.set()
            watcher.cancel()
            live.discard(job)

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

    app = Starlette(
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
    guard = BrowserGuard(app, hosts, origins, any_ip)
    guard.shut_down = shut_down
    return guard


async def _read_body(request: Request, timeout: float) -> bytes | None:
    """The request body, or None when the client disconnected during the
    upload (one info line in the log, no traceback).

    Raises:
        OpenAIError: 413 for a body over :data:`MAX_BODY` (declared or
            counted as it comes: chunked bodies too), 408 for one that did not
            arrive within ``timeout`` seconds; both close the connection. A
            body over the bound is read to its end first (within the same
            time, at most :data:`MAX_DRAIN` bytes), so that the client, still
            sending, reads the 413 instead of a connection reset; unless it
            asked to hear first (``Expect: 100-continue``): then it never sends.
    """
    declared = request.headers.get("content-length", "")
    over = declared.isdigit() and int(declared) > MAX_BODY
    deadline = time.monotonic() + timeout
    raw = bytearray()
    more = True
    try:
        while more and not over:
            message = await asyncio.wait_for(
                request.receive(), timeout=max(deadline - time.monotonic(), 0.0)
            )
            if message["type"] == "http.disconnect":
                log.info("a client left during its upload (%d bytes sent)", len(raw))
                return None
            raw += message.get("body", b"")
            more = message.get("more_body", False)
            over = len(raw) > MAX_BODY
        if over:
            if "100-continue" not in request.headers.get("expect", "").lower():
                await _drain(request, deadline, more_body=more)
            raise OpenAIError(
                413,
                f"The request body is over {MAX_BODY} bytes.",
                code="body_too_large",
                headers={"Connection": "close"},
            )
    except asyncio.TimeoutError:
        raise OpenAIError(
            408,
            f"The request body did not arrive within {timeout:g} s (--client-timeout).",
            code="request_timeout",
            headers={"Connection": "close"},
        ) from None
    return bytes(raw)


async def _drain(request: Request, deadline: float, more_body: bool) -> None:
    """Read and drop the rest of a body that is over the bound (until its
    end, ``deadline`` or :data:`MAX_DRAIN` bytes, whichever comes first)."""
    read = 0
    while more_body and read < MAX_DRAIN:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(request.receive(), timeout=left)
        except asyncio.TimeoutError:
            return
        if message["type"] == "http.disconnect":
            return
        read += len(message.get("body", b""))
        more_body = message.get("more_body", False)


def _shutting_down() -> OpenAIError:
    return OpenAIError(
        503, "The server is shutting down; retry later.", type="server_error", code="shutdown"
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


def bind_socket(host: str, port: int) -> socket.socket:
    """Resolve ``host`` and bind ``port`` on it (not yet listening), so that a
    taken port or a host that does not resolve is a clear error before the
    model is loaded (uvicorn then serves on this socket).

    Raises:
        InvalidArgumentError: naming --host or --port and what to do.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
        raise InvalidArgumentError(f"--port must be in 1..65535, got {port!r}.")
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except (socket.gaierror, UnicodeError) as e:
        raise InvalidArgumentError(
            f"--host {host!r} does not resolve to an address of this machine ({e}); use an "
            "address such as 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)."
        ) from None
    family, kind, proto, _, addr = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno in (98, 48):  # EADDRINUSE (Linux, macOS)
            raise InvalidArgumentError(
                f"--port {port}: the address {host}:{port} is already in use (another server "
                "is running there?); choose another --port or stop that server."
            ) from None
        raise InvalidArgumentError(
            f"--host {host} --port {port}: cannot listen there ({e.strerror or e}); choose "
            "another address or a port above 1023."
        ) from None
    return sock


def make_server(
    worker: Worker,
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    log_level: str = "info",
    *,
    allow_hosts: Iterable[str] = (),
    allow_origins: Iterable[str] = (),
    queue_timeout: float = QUEUE_TIMEOUT,
    client_timeout: float = CLIENT_TIMEOUT,
) -> Any:
    """A ``uvicorn.Server`` for the app (call ``.run()``, or ``.run(sockets=[s])``
    with a socket from :func:`bind_socket`; ``.should_exit = True`` stops it).

    The accepted ``Host`` names are the localhost names, ``host`` itself and
    ``allow_hosts``; bound to a wildcard address (``0.0.0.0``, ``::``) also
    any IP address literal.

    A client has ``client_timeout`` seconds to send a request's headers (from
    the moment it connects, or its previous answer ended), then as long for
    the body; a slower one is disconnected (the body: answered 408 first).
    On shutdown (a signal, ``should_exit``) the jobs of open requests are
    stopped before their next forward pass, streams get a final chunk with
    ``finish_reason: "cancelled"`` and ``[DONE]``, and the server waits for
    them (up to ``--max-forward-s`` and 10 s more) before it closes what is
    left.

    Raises:
        InvalidArgumentError: ``client_timeout`` not a number > 0.
    """
    import uvicorn

    if (
        isinstance(client_timeout, bool)
        or not isinstance(client_timeout, (int, float))
        or not 0 < client_timeout < math.inf
    ):
        raise InvalidArgumentError(f"--client-timeout must be > 0, got {client_timeout!r}.")
    hosts = {*LOCAL_NAMES, host_of(host) if ":" not in host else host.lower(), *allow_hosts}
    app = create_app(
        worker,
        api_key,
        hosts=hosts,
        any_ip=host in WILDCARD,
        origins=allow_origins,
        queue_timeout=queue_timeout,
        client_timeout=client_timeout,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        http=_timed_h11(float(client_timeout)),
        timeout_graceful_shutdown=math.ceil(worker.limits.max_forward_s) + 10,
    )
    return _server_class()(config, app.shut_down)


def _server_class() -> type:
    """``uvicorn.Server`` that, as its shutdown begins, stops the app's jobs
    (``shut_down``), so open streams end with a final chunk within one forward
    pass instead of being cut when the graceful-shutdown time runs out, and
    records the signal that stopped it (``signalled``), which the ``serve``
    command turns into its exit status. A second Ctrl-C (uvicorn's forced
    exit) exits without a traceback: the signals caught are not raised
    again once stopped (uvicorn's would reach the event loop as
    ``KeyboardInterrupt``), and the application's shutdown event still runs
    (else its task is cancelled at exit and logs one)."""
    import uvicorn

    class Server(uvicorn.Server):
        def __init__(self, config: Any, shut_down: Any):
            super().__init__(config)
            self.shut_down = shut_down
            #: the first signal that stopped it (None: none)
            self.signalled: int | None = None

        def handle_exit(self, sig: int, frame: Any) -> None:
            if self.signalled is None:
                self.signalled = sig
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self) -> Any:
            # uvicorn's, but the signals caught are not raised again on exit
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            n = self.shut_down()
            if n:
                log.info("shutting down: stopping %d request(s) after their forward pass", n)
            await super().shutdown(sockets)
            if self.force_exit and getattr(self, "lifespan", None) is not None:
                # a second Ctrl-C skips the application's shutdown event, and
                # the lifespan task cancelled at exit would log a traceback
                await self.lifespan.shutdown()

    return Server


def _timed_h11(timeout: float) -> type:
    """uvicorn's h11 protocol with a bound on slow clients: a connection that
    has not sent a request's full headers ``timeout`` seconds after it opened
    (or after its previous answer ended) is closed. While a request is being
    answered the app bounds the body (408) and the worker the rest."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class TimedH11Protocol(H11Protocol):
        _timer: asyncio.TimerHandle | None = None

        def _arm(self) -> None:
            self._disarm()
            self._timer = self.loop.call_later(timeout, self._too_slow)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                log.debug("closing a connection that sent no full request in %g s", timeout)
                if self.conn.our_state is not h11.ERROR:
                    with contextlib.suppress(h11.LocalProtocolError):
                        self.conn.send(h11.ConnectionClosed())
                self.transport.close()

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not None and not self.cycle.response_complete:
                self._disarm()  # a request is being answered

        def on_response_complete(self) -> None:
            super().on_response_complete()  # (may start a pipelined request)
            idle = self.cycle is None or self.cycle.response_complete
            if idle and not self.transport.is_closing():
                self._arm()  # the next request's headers (or the rest of this body)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return TimedH11Protocol
