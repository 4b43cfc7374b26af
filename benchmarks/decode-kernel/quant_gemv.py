"""float32 products on GGUF codes (``q4_linear`` / ``q8_linear``), and ``q4_linear_q8`` / ``q8_linear_q8``
(activations rounded to int8), against the dense float32 matmul (MKL), per row count.

    python benchmarks/decode-kernel/quant_gemv.py [THREADS]

SmolLM2-135M's projections of one layer (qkv 960x576, o 576x576, gate/up 3072x576, down 576x1536) as Q4_1
codes, and its tied 49,152 x 576 head as Q8_0 codes, against the same weights dequantised. Thirty layers'
weights are cycled through, as in a decode step, so the weights come from DRAM, not the caches. The row count
where the dense matmul starts to win is ``quant_linear.FLOAT32_MAX_ROWS`` (with int8 activations it never does).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.bench.speed import fastest_run
from kvserve.models.quant_linear import Int4Weight, Int8Weight, Q8Linear, QuantLinear
from kvserve.platform.cpu_kernels import cpu_kernels_available

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30
ROWS = [1, 2, 4, 8, 16, 24, 32, 64, 128]


def best_of(fn: Callable[[], object]) -> float:
    return fastest_run(fn, repeats=5)


def random_q4(n: int, k: int, gen: torch.Generator) -> Int4Weight:
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen)
    return Int4Weight(codes, torch.rand(n, k // 32, generator=gen) / 8, torch.randn(n, k // 32, generator=gen) / 8)


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    torch.set_num_threads(threads)
    if not cpu_kernels_available():
        raise SystemExit("kvserve's CPU kernels did not build: nothing to measure")
    gen = torch.Generator().manual_seed(0)
    weights = [[random_q4(n, k, gen) for n, k in LAYER] for _ in range(LAYERS)]
    codes = [[QuantLinear(w, torch.float32) for w in layer] for layer in weights]
    int8 = [[QuantLinear(w, torch.float32) for w in layer] for layer in weights]
    for module in (m for layer in int8 for m in layer):
        module.round_activations_to_int8()
    dense = [[w.dequantize() for w in layer] for layer in weights]
    head_codes8 = torch.randint(-128, 128, (49152, 576), dtype=torch.int8, generator=gen)
    head = Int8Weight(head_codes8, torch.rand(49152, 18, generator=gen) / 64)
    head_codes, head_dense = Q8Linear(head, torch.float32), head.dequantize()
    head_int8 = Q8Linear(head, torch.float32)
    head_int8.round_activations_to_int8()
    print(f"{threads} threads; us per layer (4 projections), averaged over {LAYERS} layers' weights; head: one call")
    print(
        "| rows | layer on codes | layer dense | dense / codes | layer int8 activations | codes / int8 | dense / int8 "
        "| head on codes | head dense | dense / codes | head int8 activations | codes / int8 |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for rows in ROWS:
        xs = [torch.randn(rows, k, generator=gen) for _, k in LAYER]
        x = torch.randn(rows, 576, generator=gen)
        on_codes = best_of(lambda xs=xs: [m(a) for layer in codes for m, a in zip(layer, xs, strict=True)])
        plain = best_of(lambda xs=xs: [F.linear(a, w) for layer in dense for w, a in zip(layer, xs, strict=True)])
        on_int8 = best_of(lambda xs=xs: [m(a) for layer in int8 for m, a in zip(layer, xs, strict=True)])
        on_codes, plain, on_int8 = (t / LAYERS * 1e6 for t in (on_codes, plain, on_int8))
        head_c = best_of(lambda x=x: head_codes(x)) * 1e6
        head_d = best_of(lambda x=x: F.linear(x, head_dense)) * 1e6
        head_i = best_of(lambda x=x: head_int8(x)) * 1e6
        print(
            f"| {rows} | {on_codes:.0f} | {plain:.0f} | {plain / on_codes:.2f}x | {on_int8:.0f} | "
            f"{on_codes / on_int8:.2f}x | {plain / on_int8:.2f}x | {head_c:.0f} | {head_d:.0f} | "
            f"{head_d / head_c:.2f}x | {head_i:.0f} | {head_c / head_i:.2f}x |"
        )


if __name__ == "__main__":
    main()
