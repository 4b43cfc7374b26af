"""A loaded model switched to row-invariant matmuls: a token's projections do not depend on its batch.

The default picks kernels by the number of rows in a step: Q4 projections run on their codes for up to
``quant_linear.max_rows(dtype)`` rows and a dequantised copy above, and a dense GEMM's own blocking follows the
row count (``packed_linear.ROW_TILE``). Here one kernel serves every row count:

- int4 projections (and the tied Q8_0 head) always run on their codes: torch's int4 kernel (bfloat16) and
  kvserve's (float32) compute each row with the same loop over the inputs whatever the row count (their
  tiles of 1 to 4 rows share it); the dequantised copies are dropped (less memory too);
- GGUF blocks (``gguf_linear.py``: K-quants, Q5_0, Q8_0, their experts) run their int8 kernel for every row count
  (no GEMM on a dequantised weight for large batches);
- dense projections, a dense tied head and each expert of a sparse MoE block run in calls of exactly
  ``ROW_TILE`` rows.

The rest of a layer is per row already (norms, rotary, SwiGLU: elementwise or one reduction per row);
attention gets the same treatment in ``attention/row_invariant.py``.
"""

from __future__ import annotations

import sys

from kvserve.models.gguf_linear import GGUFLinear
from kvserve.models.layers import Linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.moe import Experts
from kvserve.models.packed_linear import ROW_TILE
from kvserve.models.quant_linear import Q8Linear, QuantLinear


def make_batch_invariant(model: LlamaForCausalLM) -> None:
    """Switch ``model``'s matmuls to their row-invariant form, in place (call once, after loading)."""
    for module in model.modules():
        if isinstance(module, (Linear, Experts)):
            module.row_tile = ROW_TILE
        elif isinstance(module, (QuantLinear, Q8Linear)):
            module.dense, module.dense_packed = None, None  # the codes for every row count
        elif isinstance(module, GGUFLinear):
            module.dense_rows = sys.maxsize
    model.head_row_tile = ROW_TILE
