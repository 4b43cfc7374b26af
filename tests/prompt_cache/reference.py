"""The reference for Prompt Cache exactness: transformers on the same tokens, positions and attention mask."""

from __future__ import annotations

import torch

from kvserve.core.engine import LLMEngine


def prompt_cache_reference(engine: LLMEngine, hf, pml: str) -> torch.Tensor:
    """Transformers' next-token log-probs for a PML prompt: same tokens, positions and Prompt Cache mask
    (a module attends to itself and to its context, the uncached tokens to everything before them)."""
    prepared = engine.prompt_cache.prepare(pml)
    try:
        owner: list[int] = []  # per token in slot order: the module it belongs to (-1: uncached)
        bs = engine.kv.block_size
        for i, module in enumerate(prepared.modules):
            owner += [i] * (module.num_tokens // bs * bs)
        for i, module in enumerate(prepared.modules):
            owner += [i] * (module.num_tokens % bs)
        owner += [-1] * prepared.num_uncached
        n = len(owner)
        assert n == len(prepared.token_ids)
        own = torch.tensor(owner)
        pos = torch.tensor(prepared.positions)
        same = own[:, None] == own[None, :]
        before = pos[None, :] <= pos[:, None]  # within a module, position order is token order
        fresh_row = own[:, None] == -1
        index = torch.arange(n)
        # A module encoded after a context (the schema's shared prefix) also attended to the schema's own tokens
        # at those positions.
        root = [i for i, m in enumerate(prepared.modules) if m.key[1] == ""]
        context = torch.zeros(n, n, dtype=torch.bool)
        for i, module in enumerate(prepared.modules):
            if module.context_positions and root:
                at = torch.tensor(module.context_positions)
                context |= (own[:, None] == i) & (own[None, :] == root[0]) & torch.isin(pos, at)[None, :]
        allowed = ((same & before) | context) & ~fresh_row | (
            fresh_row & ((own[None, :] != -1) | (index[None, :] <= index[:, None]))
        )
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, torch.finfo(torch.float32).min)
        with torch.no_grad():
            logits = hf(
                input_ids=torch.tensor([prepared.token_ids]),
                attention_mask=mask,
                position_ids=pos[None],
                use_cache=False,
            ).logits[0, -1]
        return torch.log_softmax(logits.float(), -1)
    finally:
        engine.prompt_cache.release(prepared.modules)


def plain_reference(engine: LLMEngine, hf, pml: str) -> torch.Tensor:
    """Transformers' next-token log-probs for a PML prompt's tokens in position order at their positions: the plain
    prefill that selective recompute of every imported token equals."""
    prepared = engine.prompt_cache.prepare(pml)
    engine.prompt_cache.release(prepared.modules)
    order = sorted(range(len(prepared.positions)), key=lambda i: prepared.positions[i])
    ids = torch.tensor([[prepared.token_ids[i] for i in order]])
    positions = torch.tensor([[prepared.positions[i] for i in order]])
    n = ids.shape[1]
    # An explicit causal mask: without one, transformers reads gaps in position_ids as packed sequences.
    mask = torch.full((1, 1, n, n), torch.finfo(torch.float32).min).triu(1)
    with torch.no_grad():
        logits = hf(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits[0, -1]
    return torch.log_softmax(logits.float(), -1)
