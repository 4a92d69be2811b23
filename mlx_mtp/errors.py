"""Errors raised by mlx-mtp. Every one carries a message that names the problem
and what to do; the CLI prints it without a traceback."""


class MTPError(Exception):
    """Base class of every mlx-mtp error."""


class ModelNotFoundError(MTPError):
    """A model spec that is not a folder, a file, an alias or a reachable repo."""


class ModelLoadError(MTPError):
    """A model that exists but cannot be loaded: corrupt or incomplete, or larger
    than the memory this machine can give its weights."""


class UnsupportedModelError(MTPError):
    """A model whose architecture a method cannot run."""


class UnknownMethodError(MTPError):
    """A ``--method`` name that does not exist or is not built yet."""


class CacheNotTrimmableError(MTPError):
    """A KV cache that cannot drop rejected draft tokens (wrapped sliding window,
    recurrent state). Speculative methods refuse to continue rather than corrupt
    the output."""


class CheckpointMismatchError(MTPError):
    """Extra weights (heads, masks, adapters) made for another base model."""


class InvalidArgumentError(MTPError, ValueError):
    """A bad argument: empty prompt, max_tokens <= 0, out-of-range option."""


class ContextLengthError(InvalidArgumentError):
    """A prompt (with the new tokens asked for) longer than the model's context
    (``max_position_embeddings``); raised before the prompt is prefilled.

    Attributes:
        context / prompt_tokens / max_tokens: the numbers the message states
            (None where not given), so that another front end (the server)
            can word it for its users.
    """

    def __init__(
        self,
        message: str,
        *,
        context: int | None = None,
        prompt_tokens: int | None = None,
        max_tokens: int | None = None,
    ):
        super().__init__(message)
        self.context = context
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class ModelBusyError(MTPError):
    """A second generation started on an :class:`~mlx_mtp.api.MTPModel` whose
    previous stream has not finished (one KV cache serves one generation at a
    time)."""


class WrongThreadError(MTPError):
    """A stream of :meth:`~mlx_mtp.api.MTPModel.stream_generate` read on a
    thread other than the one that started it: MLX runs each thread's work
    on that thread's own streams, and the stream's pending work cannot move
    to another one."""
