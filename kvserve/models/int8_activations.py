"""Int8 activations for the 4-bit projections: an opt-in trade of float32 exactness for decode speed.

With float32 activations every 4-bit product (``q4_linear``) runs in float32 FMAs on the decoded codes; past a
couple of rows a step is bound by those FMAs, not by reading the weights, so each extra sequence in a batch
costs a few milliseconds (SmolLM2, 2 threads, AMD EPYC). Rounding each row's activations to int8 per group of 32
(``q4_linear_q8``, csrc/quant_gemv.cpp; llama.cpp's Q8_1, what it always does) turns a group's product into
integer byte dot products on ggml's repacked layout (8 weight rows interleaved, so one instruction multiplies 4
inputs by the codes of 8 outputs): 1.5x faster at one row, ~3x at 32, and faster than the dense float32 matmul at
every batch size, so the switched projections keep no dense copy and prefill runs them too. A tied Q8_0 head
switches the same way (``q8_linear_q8``: 8-bit codes against the int8 rows; with VNNI one instruction per 4 inputs
of 8 outputs). Everything outside the products keeps float32. The rounding is lossy (every input keeps 8 bits:
``benchmarks/int8-activations/`` measures what it costs), still the same for a row whatever runs beside it.
"""

from __future__ import annotations

from torch import nn

from kvserve.models.quant_linear import Q8Linear, QuantLinear
from kvserve.platform.cpu_kernels import cpu_kernels_available


def use_int8_activations(model: nn.Module) -> int:
    """Switch every float32 ``QuantLinear`` of ``model`` (and a Q8_0 head) to int8 activations, in place (after
    loading and ``prepack``). Returns how many 4-bit projections were switched; raises where none can be (no 4-bit
    projection run on its codes in float32, or no compiled kernels)."""
    if not cpu_kernels_available():
        raise ValueError("int8 activations run kvserve's compiled CPU kernels, and they are not available here")
    switched = sum(module.round_activations_to_int8() for module in model.modules() if isinstance(module, QuantLinear))
    if switched:
        for module in model.modules():
            if isinstance(module, Q8Linear):
                module.round_activations_to_int8()
    if not switched:
        raise ValueError(
            "int8 activations apply to 4-bit (Q4_0 / Q4_1) projections run on their codes with float32 "
            "activations, and this model has none: load a GGUF model with dtype float32 and weights native or int4"
        )
    return switched
