"""``mlx-mtp serve``: the OpenAI-compatible local server (see :mod:`mlx_mtp.server`
and docs/server.md)."""

from __future__ import annotations

import ipaddress
import signal
import sys
from pathlib import Path

import typer

from .. import distributed
from ..cli_options import (
    LOAD,
    METHOD_OPTIONS,
    MIN_P,
    RUNNER,
    SEED,
    SHARDING,
    TEMP,
    TOP_K,
    TOP_P,
    check_choices,
    interrupted_note,
    with_options,
)
from ..errors import InvalidArgumentError
from ..runners import check_runner
from ..server.worker import DEFAULT_MAX_BATCH
from ..validation import check_generation_args, float_range, typer_range

#: hosts that only this machine can reach
LOOPBACK = {"localhost", "127.0.0.1", "::1"}
#: uvicorn's log levels
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def repeatable(flag: str, help: str) -> typer.models.OptionInfo:
    """A ``typer`` option that may be given several times (None: never)."""
    return typer.Option(None, flag, help=f"{help} Repeatable.")


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _exit_on_sigterm() -> None:
    """SIGTERM (``kill``, a service manager) outside the server's own signal
    handling (before it starts capturing signals, or after it stopped)
    exits with status 143; while it serves, the server records the signal
    and :func:`exit_for_signal` exits with it once the worker has stopped."""

    def handler(signum: int, frame: object) -> None:
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to the CLI."""

    @app.command()
    @with_options(LOAD, METHOD_OPTIONS, SHARDING)
    def serve(
        max_tokens: int = typer.Option(
            512,
            "--max-tokens",
            "-n",
            **typer_range("max_tokens"),
            help="New tokens when a request does not set max_tokens.",
        ),
        temp: float = TEMP,
        top_p: float = TOP_P,
        top_k: int = TOP_K,
        min_p: float = MIN_P,
        seed: int | None = SEED,
        host: str = typer.Option(
            "127.0.0.1", "--host", help="Address to bind (default: this machine only)."
        ),
        port: int = typer.Option(8080, "--port", help="TCP port."),
        api_key: str | None = typer.Option(
            None,
            "--api-key",
            envvar="MLX_MTP_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1 requests (or $MLX_MTP_API_KEY); "
            "/health then tells others only whether the server is alive.",
        ),
        queue_size: int = typer.Option(
            8, "--queue-size", help="Requests that may wait; more get 429 with Retry-After."
        ),
        queue_timeout: float = typer.Option(
            300.0,
            "--queue-timeout",
            **float_range(0.0, above=True),
            help="Seconds a request may wait in the queue; then it is answered 503.",
        ),
        client_timeout: float = typer.Option(
            30.0,
            "--client-timeout",
            **float_range(0.0, above=True),
            help="Seconds a client has to send a request's headers, then as long for its "
            "body; a slower one is disconnected (the body: 408).",
        ),
        max_batch: int = typer.Option(
            DEFAULT_MAX_BATCH,
            "--max-batch",
            help="Plain (ntp) requests, or greedy pld, recycle, probe, hybrid, clp or draft "
            "(--method's draft model) requests with their drafts, decoded together in one "
            "forward pass "
            "(continuous batching; at most the slots bound). 1: one request at a time.",
        ),
        max_methods: int = typer.Option(
            4,
            "--max-methods",
            help="Distinct (method, options) settings kept at once, each with its KV cache "
            "(the least recently used is dropped, never --method's).",
        ),
        max_bc: int | None = typer.Option(
            None,
            "--max-bc",
            help="Most slots per forward pass a request's method may send (its BC, or its "
            "cap with auto). Default: 64, or --method's BC if larger.",
        ),
        max_tokens_limit: int | None = typer.Option(
            None,
            "--max-tokens-limit",
            help="Most new tokens a request may ask for. Default: 4096, or --max-tokens if larger.",
        ),
        max_forward_s: float = typer.Option(
            5.0,
            "--max-forward-s",
            **float_range(0.0, above=True),
            help="Seconds one forward pass may take: measured at start, it bounds the slots "
            "per pass and the prefill chunk (and so how soon a cancel or shutdown acts).",
        ),
        allow_artifacts: list[Path] | None = repeatable(
            "--allow-artifacts",
            "A folder whose heads/adapters requests may name (mtp.heads, mtp.adapter). "
            "Without it requests may not name files or repos.",
        ),
        allow_host: list[str] | None = repeatable(
            "--allow-host",
            "Another name clients may use in the Host header (besides the bound "
            "address and localhost).",
        ),
        allow_origin: list[str] | None = repeatable(
            "--allow-origin",
            "A web origin (e.g. http://localhost:3000) whose pages may call the server "
            "(CORS); '*' for any. Default: none.",
        ),
        log_level: str = typer.Option(
            "info", "--log-level", help=f"uvicorn log level: {', '.join(LOG_LEVELS)}."
        ),
        runner: str = RUNNER,
        *,
        load: dict,
        options: dict,
        pipeline_parallel: bool,
    ):
        """Serve the model over the OpenAI HTTP API (/v1/chat/completions,
        /v1/completions, /v1/models, /health). A request picks its method with
        an extra field, e.g. {"mtp": {"method": "pld"}}; --method is the default.
        Every choice is checked, and the port bound, before the model loads."""
        from ..methods import make_method
        from ..server import Limits, Worker, require_server_extra

        require_server_extra()  # before the slow model load
        if log_level not in LOG_LEVELS:
            raise typer.BadParameter(
                f"{log_level!r} is not one of {', '.join(LOG_LEVELS)}", param_hint="'--log-level'"
            )
        if queue_size < 1 or max_methods < 1 or max_batch < 1:
            raise InvalidArgumentError("--queue-size, --max-methods and --max-batch must be >= 1.")
        if not 0 < queue_timeout < float("inf"):
            raise InvalidArgumentError(f"--queue-timeout must be > 0, got {queue_timeout}.")
        if not 0 < client_timeout < float("inf"):
            raise InvalidArgumentError(f"--client-timeout must be > 0, got {client_timeout}.")
        dtype = load["dtype"]
        check_choices(load["method"], options, dtype)
        check_runner(runner)
        check_generation_args(
            max_tokens=max_tokens, temp=temp, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed
        )
        default = make_method(load["method"], **options)
        limits = Limits(
            max_bc=max_bc,
            max_tokens=max_tokens_limit,
            max_forward_s=max_forward_s,
            allow_artifacts=tuple(allow_artifacts or ()),
        )
        limits.resolve(default.block_complexity, max_tokens)
        limits.check_default(default)  # again once the forward bound is measured
        sock = None
        if distributed.is_main():  # only rank 0 serves HTTP
            from ..server.app import bind_socket

            sock = bind_socket(host, port)  # a taken port fails here, before the load
        if not is_loopback(host):  # once the address is bound: it will be served
            typer.echo(
                f"WARNING: binding {host}: other machines on the network can reach this server"
                + ("" if api_key else " and it has no --api-key")
                + ". Use the default --host 127.0.0.1 to keep it local.",
                err=True,
            )
        try:
            model, method = load["model"], load["method"]
            typer.echo(f"loading {model} ({method}) ...", err=True)
            worker = Worker(
                model,
                method,
                options,
                dtype=dtype,
                max_kv_size=load["max_kv_size"],
                kv_bits=load["kv_bits"],
                kv_group_size=load["kv_group_size"],
                max_tokens=max_tokens,
                temp=temp,
                top_p=top_p,
                top_k=top_k,
                min_p=min_p,
                seed=seed,
                queue_size=queue_size,
                max_methods=max_methods,
                pipeline=pipeline_parallel,
                runner=runner,
                limits=limits,
                max_batch=max_batch,
            )
            with interrupted_note(f"interrupted while loading {model}: the server did not start."):
                worker.start()
            if not distributed.is_main():  # the other ranks follow rank 0's worker
                worker.wait()
                return
            _serve(
                worker,
                sock,
                host,
                port,
                api_key,
                log_level,
                allow_host,
                allow_origin,
                queue_timeout,
                client_timeout,
            )
        finally:
            if sock is not None:
                sock.close()


def _serve(
    worker, sock, host, port, api_key, log_level, hosts, origins, queue_timeout, client_timeout
) -> None:
    """Serve on the bound socket until Ctrl-C or SIGTERM, then stop the worker."""
    from ..server import make_server

    lim = worker.limits.describe()
    shown = f"[{host}]" if ":" in host else host
    n_dirs = lim["artifact_folders"]
    files = f"files from {n_dirs} folder(s)" if n_dirs else "no files"
    typer.echo(
        f"limits: {lim['max_slots_per_forward']} slots per forward pass (--max-bc "
        f"{lim['max_bc']}, --max-forward-s {lim['max_forward_s']:g}), prefill "
        f"{lim.get('prefill_step', '?')} tokens per pass, max_tokens <= {lim['max_tokens']}, "
        f"{files} from requests",
        err=True,
    )
    typer.echo(
        f"serving {worker.model_id} ({worker.method}) at http://{shown}:{port}/v1 "
        f"(model id {worker.model_id!r}; Ctrl-C stops)",
        err=True,
    )
    server = make_server(
        worker,
        host,
        port,
        api_key,
        log_level,
        allow_hosts=hosts or (),
        allow_origins=origins or (),
        queue_timeout=queue_timeout,
        client_timeout=client_timeout,
    )
    _exit_on_sigterm()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
    exit_for_signal(getattr(server, "signalled", None))


def exit_for_signal(sig: int | None) -> None:
    """After the server stopped on ``sig``: raise ``KeyboardInterrupt`` for
    SIGINT (the CLI exits 130) or exit 143 for SIGTERM. The server does not
    raise the signals it caught again (:func:`mlx_mtp.server.app.make_server`),
    so the exit status is set here, by the first signal it recorded."""
    if sig == signal.SIGINT:
        raise KeyboardInterrupt
    if sig == signal.SIGTERM:
        sys.exit(128 + sig)
