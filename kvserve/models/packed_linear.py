"""Dense bfloat16 matmuls on CPU with the weight reordered once for oneDNN (AMX / avx512_bf16).

``F.linear`` on a bfloat16 CPU weight lets oneDNN reorder the weight into its blocked layout on every
call. Doing it once at load time halves the time of SmolLM2's projections from 1 to 32 rows and
still helps at 2,048 (measured with 2 threads on an AMX Xeon, torch 2.13: gate/up 3072 x 576 at 1
row 188 -> 98 us, at 32 rows 275 -> 159 us, at 2,048 rows 3.74 -> 3.49 ms; the 49,152 x 576 LM head
at 1 row 3.0 -> 1.6 ms). The arithmetic is oneDNN's either way. float32 keeps ``F.linear``: it is
the exactness mode.

The packed tensor is opaque (an MKLDNN tensor): modules keep it beside their ordinary weight, which
state dicts, tests and other code paths read. It costs a second copy of the dense weights.

oneDNN builds and caches a primitive (JIT kernels and scratch memory) per input shape: about 0.6 MiB a
row count for SmolLM2's projections, kept for the life of the process up to 1,024 shapes. A server
sees a new row count at almost every step (prompt lengths, chunks beside decodes), so its memory grew
by hundreds of MiB in ten minutes (``kvserve bench soak``). Calls above ``EXACT_ROWS`` rows are padded
to a row bucket (``bucket_rows``), at most 1/8 more rows, about 8 shapes per doubling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Rows per call in the batch-invariant mode. MKL's float32 GEMM and oneDNN's bfloat16 one pick their kernel,
# and with it the order of each row's sums, by the row count (measured with torch 2.13 on a Xeon without AMX:
# float32 gives other bits for 1 row than for 2, for 2 than for 16, and 64 than 65 rows at K = 1536; bfloat16
# at K = 1536 changes between 13 and 14 rows). A fixed count gives every row one kernel, whatever its
# neighbours. 8 rows: 2.5x the time of a 1-row call, 1.45x that of one 2,048-row call (bfloat16, 2 threads).
ROW_TILE = 8
# Decode batches up to this many rows run at their own size: few shapes, and padding would cost most there.
EXACT_ROWS = 32


def bucket_rows(count: int) -> int:
    """The row count a oneDNN call of ``count`` rows runs at: ``count`` up to ``EXACT_ROWS``, above it rounded
    up to a multiple of 1/8 of its power of two, so at most 1/8 of the rows are padding."""
    if count <= EXACT_ROWS:
        return count
    step = 1 << (count.bit_length() - 4)
    return -(-count // step) * step


def can_prepack(weight: torch.Tensor) -> bool:
    # oneDNN's bfloat16 reorder needs AVX-512 (or AVX-NE-CONVERT); an AVX2-only CPU keeps F.linear.
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and torch.backends.mkldnn.is_available()
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    )


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` (out, in) reordered for oneDNN, or None where that does not apply."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach()) if can_prepack(weight) else None


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b) for a weight from ``prepack``; x of any leading shape, run at ``bucket_rows`` rows."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])  # (M, in)
    count = rows.shape[0]
    padded = bucket_rows(count)
    if padded != count:
        rows = F.pad(rows, (0, 0, 0, padded - count))  # zero rows, sliced off below
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")  # (padded, out)
    return out[:count].reshape(*lead, out.shape[-1])


def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    row_tile: int = 0,
) -> torch.Tensor:
    """y = x W^T (+ b) through ``packed`` (``prepack(weight)``) when there is one, else ``F.linear``; with a
    ``row_tile``, in calls of exactly that many rows (``in_row_tiles``)."""
    if row_tile:
        return in_row_tiles(lambda rows: dense_linear(rows, weight, packed, bias), x, row_tile)
    if packed is not None:
        return packed_linear(x, packed, bias)
    return F.linear(x, weight, bias)


def in_row_tiles(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, tile: int) -> torch.Tensor:
    """``fn`` over the rows of x (..., in) in calls of exactly ``tile`` rows, the last one padded with zero
    rows -> (..., out). A row's result then depends on its own values only."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    count = rows.shape[0]
    pad = -count % tile
    if pad:
        rows = F.pad(rows, (0, 0, 0, pad))
    out = torch.cat([fn(rows[start : start + tile]) for start in range(0, rows.shape[0], tile)])
    return out[:count].reshape(*lead, out.shape[-1])
