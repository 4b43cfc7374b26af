"""Per-head budgets in a layer's slots (Ada-KV): a layer's kept tokens packed head after head.

A compressed layer holds ``keep`` slots of (Hkv, D) per sequence. When its KV heads keep different numbers of
tokens ``counts`` (summing to ``Hkv * keep``), the slots are read as one run of ``Hkv * keep`` (D,) entries, the
heads' tokens one after the other, each head's in position order: head h's tokens are entries
``sum(counts[:h]) ..`` of the run, entry e living in slot ``e // Hkv``, head column ``e % Hkv``. That is the
same memory as the uniform layout at the same budget, and the block tables, the pool and the scheduler see
ordinary slots. Slots written after the packing (later chunks, decoded tokens) are ordinary slots again, every
head holding the same token, until the next packing.

These functions move between the two views; the compressed cache attends each head over its own candidates
(``CompressedKVCache._attend_heads``).
"""

from __future__ import annotations

import torch


def packed_slots(counts: tuple[int, ...]) -> int:
    """Slots the packed region takes: the heads' tokens over the heads (0 when nothing is packed)."""
    return sum(counts) // len(counts) if counts else 0


def head_candidates(cached: torch.Tensor, new: torch.Tensor, counts: tuple[int, ...]) -> list[torch.Tensor]:
    """Each KV head's candidates in position order, (n_h, D): its packed tokens, the ordinary slots after them,
    then the step's new rows. ``cached`` (held, Hkv, D) are the layer's slots, ``new`` (m, Hkv, D)."""
    heads, dim = cached.shape[1], cached.shape[2]
    packed = packed_slots(counts)
    run = cached[:packed].reshape(packed * heads, dim)
    out, start = [], 0
    for h in range(heads):
        count = counts[h] if counts else 0
        out.append(torch.cat((run[start : start + count], cached[packed:, h], new[:, h])))
        start += count
    return out


def pack(kept: list[torch.Tensor]) -> torch.Tensor:
    """The heads' kept entries (n_h, D) as the slots that hold them, (sum n_h / Hkv, Hkv, D)."""
    heads, dim = len(kept), kept[0].shape[-1]
    entries = sum(k.shape[0] for k in kept)
    if entries % heads:
        raise ValueError(f"{entries} entries over {heads} KV heads do not fill whole slots")
    return torch.cat(kept).view(-1, heads, dim)
