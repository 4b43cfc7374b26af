"""One rank's forward pass over its chunk of a parallel prefill, through the backend of the job's scheme.

Kept apart from ``chunks.py``: the backends (``runahead.py``, ``tsp.py``) build on that module, and this one
picks between them.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import AttentionMetadata, LayerKVSink
from kvserve.models.llama import LlamaForCausalLM
from kvserve.parallel.chunks import ChunkJob
from kvserve.parallel.runahead import RunaheadBackend
from kvserve.parallel.tsp import TSPBackend


def run_chunk(
    model: LlamaForCausalLM, job: ChunkJob, rank: int, timeout_s: float, sink: LayerKVSink | None = None
) -> torch.Tensor:
    """This rank's final hidden states (chunk length, hidden), computed in cooperation with the other ranks."""
    backend_type = RunaheadBackend if job.scheme == "runahead" else TSPBackend
    backend = backend_type(job, rank, model, timeout_s, sink)
    start, end = backend.start, backend.end
    device = model.norm.weight.device
    ids = torch.tensor(job.token_ids[start:end], dtype=torch.long, device=device)
    if job.positions:
        positions = torch.tensor(job.positions[start:end], dtype=torch.long, device=device)
    else:
        positions = torch.arange(start, end, device=device)
    metadata = AttentionMetadata(seq_ids=(0,), query_lens=(end - start,), context_lens=(start,))
    with torch.inference_mode():
        hidden = model(ids, positions, backend, metadata)
        backend.finish()
    return hidden
