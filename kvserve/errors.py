"""Errors a user can act on: each names what was wrong, with the value and the limit."""


class KVServeError(Exception):
    """Base class for every error kvserve raises on purpose."""


class ModelLoadError(KVServeError):
    """A model file or folder could not be found, read or understood."""


class UnsupportedModelError(ModelLoadError):
    """The model uses an architecture, tensor type or tokenizer kvserve does not implement."""


class ParallelPrefillError(KVServeError):
    """A parallel prefill worker died, hung past the timeout, or reported an error."""


class TensorParallelError(KVServeError):
    """A tensor-parallel rank died, hung past the timeout or failed; the group is lost (the message says why)."""


class KVTierError(KVServeError):
    """A KV tier below the device (swap space, an offload tier's host memory or disk file) could not be created
    or failed a transfer. ``request_ids``: the requests it failed (set by the engine; empty at start-up)."""

    def __init__(self, message: str, request_ids: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.request_ids = request_ids
