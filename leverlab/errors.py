"""Errors the engine raises on purpose. The server maps each to an HTTP status."""


class LeverLabError(Exception):
    """Base class."""


class RequestError(LeverLabError, ValueError):
    """The request itself is wrong (empty prompt, too long, bad parameter): HTTP 400. `param` names the field
    and `code` is OpenAI's error code (context_length_exceeded) where there is one."""

    def __init__(self, message: str = "", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code


class EngineOverloaded(LeverLabError):
    """The waiting queue is full: HTTP 503 with Retry-After. Admitted requests are unaffected."""


class EngineDeadError(LeverLabError):
    """The engine loop (or a worker) died; every request in flight fails with this: HTTP 503."""


class UnsupportedLever(LeverLabError, ValueError):
    """A lever flag names something not built (yet): refused with a clear message, never ignored."""


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died, hung or fell out of step: the engine cannot continue (HTTP 503)."""


class ModelNotFound(LeverLabError, FileNotFoundError):
    """A model (or tokenizer) is neither a local path nor a Hub id found in the cache or downloadable."""
