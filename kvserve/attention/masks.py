"""Boolean attention masks (True = attend) for causal and sliding-window attention over a cache."""

from __future__ import annotations

import torch


def causal_mask(
    q_len: int, ctx_len: int, window: int | None = None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(q_len, ctx_len + q_len): query i sits at cache position ctx_len + i and sees keys up to there,
    and with a ``window`` only the last ``window`` of them (its own included)."""
    rows = torch.arange(q_len, device=device).unsqueeze(1) + ctx_len  # (T, 1)
    cols = torch.arange(ctx_len + q_len, device=device).unsqueeze(0)  # (1, ctx + T)
    mask = cols <= rows
    if window is not None:
        mask &= cols > rows - window
    return mask


def window_binds(window: int | None, seq_len: int) -> bool:
    """Whether a ``window`` hides anything from some query of a sequence ``seq_len`` tokens long."""
    return window is not None and seq_len > window
