"""The baseline KV-Runahead is measured against: tensor/sequence-parallel prefill (TSP).

The prompt is split evenly; per layer every rank all-gathers every other rank's keys and values and
attends its own queries over the keys up to its chunk's end. Every rank receives the whole context's
KV at every layer, and the ranks wait for the slowest one (the last chunk attends over the most keys)
at each layer's collective: what the uneven, point-to-point KV-Runahead avoids. Sliding-window layers skip
the all-gather: each rank gets only the rows its window reaches, point-to-point (``window_kv.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvserve.attention.backend import LayerKVSink
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunks import ChunkBackend, ChunkJob


class TSPBackend(ChunkBackend):
    def __init__(self, job: ChunkJob, rank: int, model: LlamaForCausalLM, timeout_s: float, sink: LayerKVSink | None):
        super().__init__(job, rank, model, timeout_s, sink)
        b = job.boundaries
        self.sizes = [end - start for start, end in zip(b, b[1:], strict=False)]
        self.padded = max(self.sizes)  # all_gather wants equal shapes: chunks are padded to the longest

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object) -> torch.Tensor:
        if self.window_of(layer) is not None:
            return self.attend_window(layer, q, self.own_kv(k, v))
        own = self.own_kv(k, v).cpu()
        if own.shape[1] < self.padded:
            own = torch.cat((own, own.new_zeros(2, self.padded - own.shape[1], *self.kv_shape)), dim=1)
        parts = [torch.empty_like(own) for _ in self.sizes]
        self.wait(dist.all_gather(parts, own, async_op=True), f"all-gathering layer {layer}'s KV")
        kv = torch.cat([part[:, :size] for part, size in zip(parts, self.sizes, strict=True)], dim=1)  # (2, C, Hkv, D)
        kv = kv.to(q.device)
        self.deliver(layer, q, kv[0], kv[1])
        return self.attend(q, kv[:, : self.end], self.start)
