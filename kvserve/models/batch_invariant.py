"""A loaded model switched to row-invariant matmuls: a token's projections do not depend on its batch.

The default picks kernels by the number of rows in a step: Q4 projections run the int4 kernel for up to
``INT4_MAX_ROWS`` rows and a dequantised bfloat16 copy above, and a dense GEMM's own blocking follows the
row count (``packed_linear.ROW_TILE``). Here one kernel serves every row count:

- int4 projections (and the tied head's Q8_0 planes) always run torch's int4 kernel, which computes each
  row with the same loop over the inputs whatever the row count (its tiles of 1 to 4 rows share it); the
  dequantised copies are dropped (less memory too);
- dense projections and a dense tied head run in calls of exactly ``ROW_TILE`` rows.

The rest of a layer is per row already (norms, rotary, SwiGLU: elementwise or one reduction per row);
attention gets the same treatment in ``attention/row_invariant.py``.
"""

from __future__ import annotations

from kvserve.models.layers import Linear
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.packed_linear import ROW_TILE
from kvserve.models.quant_linear import Int8PlanesLinear, QuantLinear


def make_batch_invariant(model: LlamaForCausalLM) -> None:
    """Switch ``model``'s matmuls to their row-invariant form, in place (call once, after loading)."""
    for module in model.modules():
        if isinstance(module, Linear):
            module.row_tile = ROW_TILE
        elif isinstance(module, (QuantLinear, Int8PlanesLinear)):
            module.dense, module.dense_packed = None, None  # the int4 kernel for every row count
    model.head_row_tile = ROW_TILE
