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
