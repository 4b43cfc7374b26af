"""Parallel prefill across processes: KV-Runahead and the tensor/sequence-parallel baseline.

The only package that imports ``torch.distributed``.
"""

from kvserve.parallel.chunk_forward import run_chunk
from kvserve.parallel.chunks import SCHEMES, ChunkJob
from kvserve.parallel.group import PrefillGroup, WorkerModel

__all__ = ["SCHEMES", "ChunkJob", "PrefillGroup", "WorkerModel", "run_chunk"]
