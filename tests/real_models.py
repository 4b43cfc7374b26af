"""The real models tests load in this process, loaded once per set of load options and handed out again.

A real model takes seconds to load on a small CPU (the float32 default model, int4 codes plus dense copies, about
ten), and most real-model tests need one of a handful of variants: the session shares them instead of loading
one per engine.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from kvserve.models import LoadedModel, load_model
from kvserve.models.catalog import SHIPPED_MODELS

# Loaded real models by (model, dtype, weights, batch_invariant, int8_activations). The fixtures' models stay
# loaded for the session anyway; the least recently used of the others are dropped beyond this many.
_LOADED: OrderedDict[tuple, LoadedModel] = OrderedDict()
_MAX_LOADED = 6


def shared_load(
    path=None,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    progress=None,
    weights: str = "native",
    batch_invariant: bool = False,
    tokenizer=None,
    chat_template=None,
    shard=None,
    int8_activations: bool = False,
) -> LoadedModel:
    """``load_model`` with its signature; a shipped model on CPU without a tokenizer, template or shard comes from
    ``_LOADED`` (each load's own model otherwise); ``progress`` hears only of the first load."""
    options = dict(weights=weights, batch_invariant=batch_invariant, int8_activations=int8_activations)
    shipped = path is None or (isinstance(path, str) and path in SHIPPED_MODELS)
    own_options = tokenizer is not None or chat_template is not None or shard is not None
    if not shipped or own_options or torch.device(device).type != "cpu":
        return load_model(path, dtype, device, progress, tokenizer=tokenizer, chat_template=chat_template, shard=shard,
                          **options)  # fmt: skip
    key = (path or "smollm2-135m", dtype, weights, batch_invariant, int8_activations)
    if key not in _LOADED:
        _LOADED[key] = load_model(path, dtype, device, progress, **options)
        while len(_LOADED) > _MAX_LOADED:
            _LOADED.popitem(last=False)
    _LOADED.move_to_end(key)
    loaded = _LOADED[key]
    if hasattr(loaded.model, "decode_chain"):
        loaded.model.decode_chain = False  # as a fresh load has it: made at the next decode (a test may set None)
    return loaded
