"""One rank's share of a parallel prefill: its chunk of the prompt through the model, with an attention
backend that brings in the keys and values of the earlier tokens (KV-Runahead or the TSP baseline).

Every rank runs the whole model over its own tokens only, at their absolute positions; the backends
differ in how a layer obtains the KV of tokens [0, start): passed along the chain point-to-point
(``runahead.py``) or all-gathered from every rank (``tsp.py``). The last rank's backend also hands the
full KV of each layer to a ``sink`` (the engine writes it into its paged cache).

Over a quantized cache (``ChunkJob.kv_quant``) a rank turns its keys and values into the cache's rows
(``attention/kv_quant.py``) before anything else: the rows are what travels (half or a quarter of the bytes), what
every rank attends over (read back, as the one-process engine's queries read its cache) and what the sink stores.

A model's sliding-window layers (Gemma 3's) apply their window on every rank and pass only the rows it reaches
(``window_kv.py``); its global layers go through the scheme's backend as above.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch

from kvserve.attention.backend import AttentionBackend, LayerKVSink
from kvserve.attention.kv_quant import KVQuant
from kvserve.attention.paged import attend_prefill
from kvserve.errors import ParallelPrefillError
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.votes import PromptVotes
from kvserve.parallel.window_kv import WindowKV

SCHEMES = ("runahead", "tsp")


@dataclass(frozen=True)
class ChunkJob:
    """What every rank of one parallel prefill needs to know."""

    scheme: str  # "runahead" or "tsp"
    token_ids: tuple[int, ...]
    boundaries: tuple[int, ...]  # b_0 = 0 < b_1 < ... < b_p = len(token_ids); rank r computes [b_r, b_r+1)
    positions: tuple[int, ...] = ()  # each token's position id (a Prompt Cache module's); (): its index
    # A compressing policy's votes (KVPolicy.votes over the whole prompt): queries vote_from.. score the keys
    # with these weights; (): no scores (parallel/votes.py).
    vote_from: int = 0
    vote_weights: tuple[float, ...] = ()
    kv_quant: str | None = None  # int8 / int4: the KV passes as the quantized cache's rows

    def __post_init__(self) -> None:
        if self.scheme not in SCHEMES:
            raise ValueError(f"scheme must be one of {SCHEMES}, got {self.scheme!r}")
        b = self.boundaries
        if b[0] != 0 or b[-1] != len(self.token_ids) or any(x >= y for x, y in zip(b, b[1:], strict=False)):
            raise ValueError(f"boundaries {b} do not split {len(self.token_ids)} tokens into non-empty chunks")
        if self.positions and len(self.positions) != len(self.token_ids):
            raise ValueError(f"{len(self.positions)} positions for {len(self.token_ids)} tokens")
        if self.vote_weights and len(self.vote_weights) != len(self.token_ids) - self.vote_from:
            raise ValueError(
                f"{len(self.vote_weights)} vote weights for queries {self.vote_from}..{len(self.token_ids) - 1}"
            )

    @property
    def world_size(self) -> int:
        return len(self.boundaries) - 1


class ChunkBackend(AttentionBackend):
    """Shared by both schemes: where this rank's chunk starts, the timeout, and the sink."""

    def __init__(self, job: ChunkJob, rank: int, model: LlamaForCausalLM, timeout_s: float, sink: LayerKVSink | None):
        self.job, self.rank = job, rank
        self.start, self.end = job.boundaries[rank], job.boundaries[rank + 1]
        config = model.config
        self.quant = KVQuant(job.kv_quant, config.head_dim) if job.kv_quant is not None else None
        self.kv_shape = (config.num_kv_heads, self.quant.row_bytes if self.quant else config.head_dim)
        self.num_layers = config.num_layers
        self.dtype = torch.uint8 if self.quant else model.norm.weight.dtype
        self.timeout = timedelta(seconds=timeout_s)
        self.sink = sink
        self.windows = None
        if any(w is not None for w in config.layer_windows):
            if job.vote_weights:  # a compressing policy's votes assume every layer sees the whole prompt
                raise ValueError("a parallel prefill does not score votes over a model with sliding-window layers")
            self.windows = WindowKV(job.boundaries, rank, config.layer_windows, self.kv_shape, self.dtype, self.wait)
        self.votes = None
        if job.vote_weights:
            weights = torch.tensor(job.vote_weights, dtype=torch.float32)
            self.votes = PromptVotes(job.vote_from, weights, job.boundaries, rank, self.num_layers, self.wait)
        self.delivered: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []

    def own_kv(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's keys and values as they travel: one (2, T, Hkv, D) tensor, or the quantized cache's rows
        (2, T, Hkv, row_bytes) uint8."""
        if self.quant is None:
            return stacked(k, v)
        return self.quant.quantize(self.quant.rotated(stacked(k, v)))

    def attend(self, q: torch.Tensor, kv: torch.Tensor, ctx_len: int, window: int | None = None) -> torch.Tensor:
        """Causal attention of q (T, H, D) at positions ctx_len.. over ``kv`` (``own_kv``'s form, ctx_len + T
        tokens), each query seeing the last ``window`` of them (None: all)."""
        if self.quant is None:
            return attend_prefill(q, kv[0], kv[1], ctx_len, window)
        keys, values = self.quant.dequantize(kv, q.dtype)
        out = attend_prefill(self.quant.rotated(q).to(q.dtype), keys, values, ctx_len, window)
        return self.quant.rotated(out).to(q.dtype)

    def window_of(self, layer: int) -> int | None:
        return self.windows.window_of(layer) if self.windows is not None else None

    def attend_window(self, layer: int, q: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
        """A sliding-window layer: this rank's rows ``own`` out to the ranks whose windows reach them, the rows its
        own window reaches in, attention over those (the last rank's sink gets the layer after the pass)."""
        kv, first = self.windows.exchange(layer, own)
        return self.attend(q, kv, self.start - first, self.windows.window_of(layer))

    def deliver(self, layer: int, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A layer's part once this rank has the keys (C, Hkv, D) of its whole context: its votes go out, and
        the last rank hands the KV to its sink, at once, or with the scores once every share is in."""
        own = self.votes.share(layer, q, keys) if self.votes is not None else None
        if self.sink is None:
            return
        if self.votes is None:
            self.sink(layer, keys, values, None)
        else:
            self.delivered.append((layer, keys, values, own))

    def wait(self, work: object, what: str) -> None:
        """Wait for a torch.distributed request; a dead or hung peer becomes a ParallelPrefillError."""
        try:
            completed = work.wait(timeout=self.timeout)
        except RuntimeError as exc:  # gloo: connection closed by a dead peer, or its own timeout
            raise ParallelPrefillError(f"rank {self.rank}: {what} failed: {exc}") from exc
        if completed is False:
            raise ParallelPrefillError(f"rank {self.rank}: {what} timed out after {self.timeout.total_seconds():g} s")

    def finish(self) -> None:
        """Called after the forward pass: wait for whatever this rank still has in flight."""
        if self.windows is not None:
            self.windows.finish(self.sink)
        if self.votes is None:
            return
        self.votes.finish()
        for layer, keys, values, own in self.delivered:
            self.sink(layer, keys, values, self.votes.total(layer, own))
        self.delivered.clear()


def stacked(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Keys and values as one contiguous (2, T, Hkv, D) tensor: one message instead of two."""
    return torch.stack((k, v))
