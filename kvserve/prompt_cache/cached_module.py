"""A stored Prompt Cache module: its tokens and where its keys and values are (``store.py`` keeps them).

Plain data that both the store and the module files (``disk.py``) use, apart from both so neither imports the
other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class CachedModule:
    """One module's tokens and where its keys and values are."""

    key: tuple[str, str]  # (schema, module); module "" = the schema's own text
    token_ids: tuple[int, ...]
    positions: tuple[int, ...]
    seq_id: int | None = None  # the module sequence holding its device blocks, while it has them
    host_kv: tuple[torch.Tensor, torch.Tensor] | None = None  # host tier: (L, n, Hkv, D) keys, values
    pins: int = 0  # requests using it now (and its encoding while it runs)
    stored: bool = True  # False once evicted or removed: freed when the last pin goes
    hash_salt: tuple = field(default=())
    encoding: bool = False  # its encoding is queued or running: its blocks hold no keys yet
    context_ids: tuple[int, ...] = ()  # tokens it attends to while encoded (not its own: not stored with it)
    context_positions: tuple[int, ...] = ()
    encode_seq_id: int | None = None  # while encoding after a context: the scratch sequence the prefill runs in

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def encoded(self) -> bool:
        return (self.seq_id is not None and not self.encoding) or self.host_kv is not None
