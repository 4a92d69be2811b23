"""``mlx-mtp serve``: the OpenAI-compatible local server (see :mod:`mlx_mtp.server`)."""

from __future__ import annotations

import ipaddress

import typer

from .. import distributed
from ..errors import InvalidArgumentError
from ..validation import typer_range

#: hosts that only this machine can reach
LOOPBACK = {"localhost", "127.0.0.1", "::1"}


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server reachable from this machine only."""
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def register(app: typer.Typer) -> None:
    """Add the ``serve`` command to the CLI."""
    # here, not at the top: mlx_mtp.cli imports this module while it loads
    from ..cli import LOAD, METHOD_OPTIONS, PIPELINE, TEMP, TOP_P, with_options

    @app.command()
    @with_options(LOAD, METHOD_OPTIONS)
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
        host: str = typer.Option(
            "127.0.0.1", "--host", help="Address to bind (default: this machine only)."
        ),
        port: int = typer.Option(8080, "--port", help="TCP port."),
        api_key: str | None = typer.Option(
            None,
            "--api-key",
            envvar="MLX_MTP_API_KEY",
            help="Require 'Authorization: Bearer KEY' on /v1 requests (or $MLX_MTP_API_KEY).",
        ),
        queue_size: int = typer.Option(
            8, "--queue-size", help="Requests that may wait; more get 429 with Retry-After."
        ),
        max_methods: int = typer.Option(
            4,
            "--max-methods",
            help="(method, options) pairs kept loaded at once, each with its KV cache.",
        ),
        log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
        pipeline: bool = PIPELINE,
        *,
        load: dict,
        options: dict,
    ):
        """Serve the model over the OpenAI HTTP API (/v1/chat/completions,
        /v1/completions, /v1/models, /health). A request picks its method with
        an extra field, e.g. {"mtp": {"method": "pld"}}; --method is the default."""
        from ..server import Worker, make_server, require_server_extra

        require_server_extra()  # before the slow model load
        if not 0 < port < 65536:
            raise InvalidArgumentError(f"--port must be in 1..65535, got {port}.")
        if queue_size < 1 or max_methods < 1:
            raise InvalidArgumentError("--queue-size and --max-methods must be >= 1.")
        if not is_loopback(host):
            typer.echo(
                f"WARNING: binding {host}: other machines on the network can reach this server"
                + ("" if api_key else " and it has no --api-key")
                + ". Use the default --host 127.0.0.1 to keep it local.",
                err=True,
            )
        model, method = load["model"], load["method"]
        typer.echo(f"loading {model} ({method}) ...", err=True)
        worker = Worker(
            model,
            method,
            options,
            dtype=load["dtype"],
            max_kv_size=load["max_kv_size"],
            max_tokens=max_tokens,
            temp=temp,
            top_p=top_p,
            queue_size=queue_size,
            max_methods=max_methods,
            pipeline=pipeline,
        )
        worker.start()
        if not distributed.is_main():  # only rank 0 serves HTTP; the others follow it
            worker.wait()
            return
        shown = f"[{host}]" if ":" in host else host
        typer.echo(
            f"serving {model} ({method}) at http://{shown}:{port}/v1 "
            f"(model id {model!r}; Ctrl-C stops)",
            err=True,
        )
        try:
            make_server(worker, host, port, api_key, log_level).run()
        finally:
            worker.stop()
