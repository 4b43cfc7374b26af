"""KV-Runahead (Cho et al., ICML'24, https://arxiv.org/abs/2405.05329): the KV cache runs ahead along a chain.

Rank r computes tokens [b_r, b_r+1) of the prompt. Per layer it receives the keys and values of
tokens [0, b_r) from rank r - 1, appends its own, attends causally over the lot, and sends the
cumulative [0, b_r+1) on to rank r + 1, point-to-point. The receives for every layer are posted before
the forward pass starts, so a message arriving while the rank computes its own q/k/v projections
costs no waiting (the overlap the paper relies on); sends are asynchronous. The last rank ends with
the whole prompt's KV, and produces the first token. Later chunks attend over more keys, so the
partition is uneven (``partition.py``). Sliding-window layers leave the chain: each rank gets only the rows
its window reaches, from the ranks that computed them (``window_kv.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvserve.attention.backend import LayerKVSink
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunks import ChunkBackend, ChunkJob


class RunaheadBackend(ChunkBackend):
    def __init__(self, job: ChunkJob, rank: int, model: LlamaForCausalLM, timeout_s: float, sink: LayerKVSink | None):
        super().__init__(job, rank, model, timeout_s, sink)
        self.last = rank == job.world_size - 1
        self.received: dict[int, tuple[torch.Tensor, object]] = {}
        if rank > 0:  # one message per global layer: (2, b_r, Hkv, D or row bytes), tagged with the layer
            for layer in range(self.num_layers):
                if self.window_of(layer) is None:  # window layers pass their window's rows (window_kv.py)
                    buffer = torch.empty(2, self.start, *self.kv_shape, dtype=self.dtype)
                    self.received[layer] = (buffer, dist.irecv(buffer, src=rank - 1, tag=layer))
        # (layer, tensor, request) per global layer: tensors stay alive until their send completes
        self.sending: list[tuple[int, torch.Tensor, object]] = []

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, metadata: object) -> torch.Tensor:
        own = self.own_kv(k, v)
        if self.window_of(layer) is not None:
            return self.attend_window(layer, q, own)
        if self.rank > 0:
            buffer, work = self.received[layer]
            self.wait(work, f"receiving layer {layer}'s KV from rank {self.rank - 1}")
            kv = torch.cat((buffer.to(own.device), own), dim=1)  # (2, b_r+1, Hkv, D)
        else:
            kv = own
        if not self.last:
            sent = kv.cpu()
            self.sending.append((layer, sent, dist.isend(sent, dst=self.rank + 1, tag=layer)))
        self.deliver(layer, q, kv[0], kv[1])
        return self.attend(q, kv, self.start)

    def finish(self) -> None:
        for layer, _, work in self.sending:
            self.wait(work, f"sending layer {layer}'s KV to rank {self.rank + 1}")
        self.sending.clear()
        super().finish()
