"""Sliding-window layers over a parallel prefill: each rank receives only the keys its window reaches.

A query at position p of a window layer sees keys p - W + 1 .. p, so rank d's chunk [b_d, b_d+1) needs, of the
tokens before it, only the last W - 1: rows [max(0, b_d - W + 1), b_d). Each earlier rank sends straight to d its
part of those rows (``window_transfers``, ``attends=True``), instead of the cumulative [0, b_d) of the KV-Runahead
chain or every chunk of the TSP all-gather; d waits for them before it attends.

The last rank also stores the whole prompt's KV in the engine's cache, window layers included: a one-process
prefill writes every row (a window KV group holds the whole prompt for that step, and its full blocks keep their
prefix hashes after they leave the window), so the parallel one writes the same. The rows before the last rank's
window travel to it apart (``attends=False``) and are waited for only after its forward pass, off the attention
path; the sink gets those layers then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kvserve.attention.backend import LayerKVSink

Wait = Callable[[object, str], None]  # ChunkBackend.wait: a request, what it is for (timeouts, dead peers)


@dataclass(frozen=True)
class Transfer:
    """Rows [lo, hi) of rank ``src``'s chunk, sent to rank ``dst``: for its attention, or only to be stored."""

    src: int
    dst: int
    lo: int
    hi: int
    attends: bool

    @property
    def rows(self) -> int:
        return self.hi - self.lo


def window_transfers(boundaries: Sequence[int], window: int) -> tuple[Transfer, ...]:
    """Every message of one window layer (``window`` positions a query sees, its own included) over the chunks
    ``boundaries``: each later rank's window rows from each earlier chunk, and for the last rank the rest of the
    earlier chunks, which it stores. Attention rows come first for each sender, so they are sent first."""
    if window < 1:
        raise ValueError(f"a sliding window must be >= 1 positions, got {window}")
    last = len(boundaries) - 2
    attending, stored = [], []
    for dst in range(1, last + 1):
        first = max(0, boundaries[dst] - (window - 1))  # the first row the chunk's first query sees
        for src in range(dst):
            lo, hi = boundaries[src], boundaries[src + 1]
            if max(lo, first) < hi:
                attending.append(Transfer(src, dst, max(lo, first), hi, True))
            if dst == last and lo < min(hi, first):
                stored.append(Transfer(src, dst, lo, min(hi, first), False))
    return tuple(attending + stored)


@dataclass(frozen=True)
class PassedRows:
    """Rows of keys and values (a row: every KV head of one token, K and V) one parallel prefill passes between
    ranks, summed over layers."""

    untrimmed: int  # every layer passed as a global one
    passed: int  # with the windows
    attending: int  # of ``passed``, what receivers wait for before they attend (the rest: the last rank stores it)


def passed_rows(boundaries: Sequence[int], layer_windows: Sequence[int | None], scheme: str) -> PassedRows:
    """What a prefill over ``boundaries`` passes: global layers the chain's cumulative KV (runahead) or every padded
    chunk to every rank (tsp); window layers ``window_transfers``."""
    p = len(boundaries) - 1
    if scheme == "runahead":
        whole = sum(boundaries[1:p])
    else:
        whole = p * (p - 1) * max(b - a for a, b in zip(boundaries, boundaries[1:], strict=False))
    passed = attending = 0
    for w in layer_windows:
        transfers = window_transfers(boundaries, w) if w is not None else ()
        passed += sum(t.rows for t in transfers) if w is not None else whole
        attending += sum(t.rows for t in transfers if t.attends) if w is not None else whole
    return PassedRows(whole * len(layer_windows), passed, attending)


class WindowKV:
    """One rank's end of every window layer's exchange. Receives are posted at once (before the forward pass),
    as the chain's are; tags ``2 * num_layers + layer`` (attention rows) and ``3 * num_layers + layer`` (stored
    rows) keep clear of the chain's ``layer`` and the votes' ``num_layers + layer``."""

    def __init__(
        self,
        boundaries: Sequence[int],
        rank: int,
        layer_windows: Sequence[int | None],
        row_shape: tuple[int, ...],
        dtype: torch.dtype,
        wait: Wait,
    ) -> None:
        self.rank, self.start, self.wait = rank, boundaries[rank], wait
        self.last = rank == len(boundaries) - 2
        self.num_layers = len(layer_windows)
        self.windows = {layer: w for layer, w in enumerate(layer_windows) if w is not None}
        self.plans = {layer: window_transfers(boundaries, w) for layer, w in self.windows.items()}
        self.received: dict[tuple[int, bool], list[tuple[torch.Tensor, object]]] = {}
        for layer, plan in self.plans.items():
            for attends in (True, False):
                self.received[layer, attends] = []
            for t in plan:  # in row order: the received parts concatenate into a run of rows
                if t.dst == rank:
                    buffer = torch.empty(2, t.rows, *row_shape, dtype=dtype)
                    work = dist.irecv(buffer, src=t.src, tag=self._tag(layer, t))
                    self.received[layer, t.attends].append((buffer, work))
        self.sending: list[tuple[torch.Tensor, object, str]] = []  # tensors stay alive until their send completes
        self.kept: list[tuple[int, torch.Tensor]] = []  # the last rank's window layers, stored after the pass

    def window_of(self, layer: int) -> int | None:
        return self.windows.get(layer)

    def _tag(self, layer: int, transfer: Transfer) -> int:
        return (2 if transfer.attends else 3) * self.num_layers + layer

    def exchange(self, layer: int, own: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Send this rank's rows of window layer ``layer`` (own: (2, chunk, Hkv, D or row bytes)) to the ranks that
        need them and receive the ones this rank attends over: (2, rows, ...) from row ``first`` to the chunk's
        end, and ``first``."""
        for t in self.plans[layer]:
            if t.src == self.rank:
                rows = own[:, t.lo - self.start : t.hi - self.start].contiguous().cpu()
                what = f"sending layer {layer}'s window KV to rank {t.dst}"
                self.sending.append((rows, dist.isend(rows, dst=t.dst, tag=self._tag(layer, t)), what))
        parts = []
        for buffer, work in self.received[layer, True]:
            self.wait(work, f"receiving layer {layer}'s window KV")
            parts.append(buffer.to(own.device))
        kv = torch.cat((*parts, own), dim=1) if parts else own
        first = self.start - sum(part.shape[1] for part in parts)
        if self.last:
            self.kept.append((layer, kv))
        return kv, first

    def finish(self, sink: LayerKVSink | None) -> None:
        """After the forward pass: wait for the sends; the last rank hands each window layer's whole KV, the stored
        rows before its window first, to ``sink``."""
        for _, work, what in self.sending:
            self.wait(work, what)
        self.sending.clear()
        for layer, kv in self.kept:
            parts = []
            for buffer, work in self.received[layer, False]:
                self.wait(work, f"receiving layer {layer}'s KV to store")
                parts.append(buffer.to(kv.device))
            whole = torch.cat((*parts, kv), dim=1) if parts else kv
            if sink is not None:
                sink(layer, whole[0], whole[1], None)
        self.kept.clear()
