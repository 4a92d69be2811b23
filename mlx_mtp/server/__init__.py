"""``mlx-mtp serve``: an OpenAI-compatible local HTTP server.

- :mod:`.protocol`: the OpenAI wire format (request checks, response objects,
  errors, stop strings); no web framework.
- :mod:`.limits`: what a request may ask (slots per forward pass, new tokens,
  files), and the forward-time bound measured at start-up.
- :mod:`.events`: what the worker tells a request's handler (dataclasses).
- :mod:`.worker`: the one thread that owns the model and runs generations from
  a bounded queue.
- :mod:`.app`: the Starlette routes, the browser guard and the uvicorn server
  (the optional extra ``mlx-mtp[server]``).

    from mlx_mtp.server import Limits, Worker, make_server
    worker = Worker("smollm2-135m", "pld", limits=Limits(max_forward_s=2.0))
    worker.start()
    make_server(worker, port=8080).run()

The user's guide is docs/server.md.
"""

from __future__ import annotations

from typing import Any

from ..errors import MTPError
from .limits import Limits
from .protocol import OpenAIError, StopCutter
from .worker import Job, Worker


class ServerDependencyError(MTPError):
    """The web stack of the ``server`` extra (starlette, uvicorn) is not installed."""


def require_server_extra() -> None:
    """Check that starlette and uvicorn can be imported.

    Raises:
        ServerDependencyError: naming the missing package and the install command.
    """
    import importlib.util

    missing = [p for p in ("starlette", "uvicorn") if importlib.util.find_spec(p) is None]
    if missing:
        raise ServerDependencyError(
            f"`mlx-mtp serve` needs {' and '.join(missing)}, which are not installed. "
            "Install the server extra: pip install 'mlx-mtp[server]'"
        )


def make_server(*args: Any, **kwargs: Any) -> Any:
    """See :func:`mlx_mtp.server.app.make_server` (checks the extra first)."""
    require_server_extra()
    from .app import make_server as _make

    return _make(*args, **kwargs)


__all__ = [
    "Job",
    "Limits",
    "OpenAIError",
    "ServerDependencyError",
    "StopCutter",
    "Worker",
    "make_server",
    "require_server_extra",
]
