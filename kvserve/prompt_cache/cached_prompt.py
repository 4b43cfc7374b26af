"""Where a Prompt Cache prompt's cached head comes from: plain data that ``cache.py`` builds and the scheduler
reads from the request (``core/request.py``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CachedPrompt:
    """Where a Prompt Cache prompt's cached head comes from (plain data for the scheduler).

    The prompt's first ``len(shared_blocks) * block_size`` tokens are imported modules' full blocks,
    shared as they are; the next ``len(tail_slots)`` tokens are copied from those device slots (the
    modules' partial last blocks, which cannot be shared once other tokens follow them).

    With one KV group per layer (a compressing policy), each layer holds the slots its policy kept of the
    modules, known once they are encoded: the scheduler fills in ``group_shared[g]`` and ``group_tails[g]``,
    layer g's, when the request is admitted; the prompt's first ``num_tokens`` tokens are the modules'
    (however many slots each layer keeps of them). With sliding-window KV groups, ``group_shared[g]`` and
    ``group_tails[g]`` are group g's blocks and slots of the same tokens (``shared_blocks`` and ``tail_slots``
    are group 0's), known when the modules are pinned."""

    shared_blocks: tuple[int, ...] = ()
    tail_slots: tuple[int, ...] = ()
    # The module sequences holding them (or, while a module is encoded after its context, the scratch sequence its
    # encoding runs in): the prompt is admitted once none of them is still encoding.
    module_seq_ids: tuple[int, ...] = ()
    group_shared: tuple[tuple[int, ...], ...] = ()
    group_tails: tuple[tuple[int, ...], ...] = ()
    num_tokens: int = 0
    # Selective recompute (prompt_cache/blend.py): indices of the module tokens that may be recomputed (in the
    # sequence's own, copied blocks: none lies in ``shared_blocks``) and how many of them to recompute.
    recompute: tuple[int, ...] = ()
    recompute_count: int = 0
    recompute_probe: tuple[int, ...] = ()  # the candidates whose layer-1 KV can deviate (prompt_cache/recompute.py)

    def group_slots(self, block_size: int) -> list[int]:
        """Slots each layer holds once the modules are imported."""
        return [len(b) * block_size + len(t) for b, t in zip(self.group_shared, self.group_tails, strict=True)]

    def frozen_slots(self, block_size: int) -> tuple[int, ...]:
        """Per layer, the leading slots in shared blocks: a compressing policy never rewrites them."""
        return tuple(len(b) * block_size for b in self.group_shared)
