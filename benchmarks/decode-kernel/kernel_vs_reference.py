"""The paged decode kernel against its torch reference (gather + masked SDPA), one layer, SmolLM2's heads
(9 query, 3 KV, head dim 64), and in bfloat16 also Gemma 3's (4 query, 1 KV, head dim 256), blocks of 16:
microseconds per call and the KV bytes read per second.

    python benchmarks/decode-kernel/kernel_vs_reference.py [threads]
"""

import sys
import time
from collections.abc import Callable

import torch

from kvserve.attention.decode import paged_decode, paged_decode_reference


def timed(fn: Callable[..., object], *args: object, repeats: int = 20, **kwargs: object) -> float:
    fn(*args, **kwargs)
    start = time.perf_counter()
    for _ in range(repeats):
        fn(*args, **kwargs)
    return (time.perf_counter() - start) / repeats * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    print("| dtype | heads (q/kv x dim) | batch | context | kernel (us) | GB/s | with weights (us) | reference (us) "
          "| speed-up |")  # fmt: skip
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    cases = [(torch.bfloat16, 9, 3, 64), (torch.bfloat16, 4, 1, 256), (torch.float32, 9, 3, 64)]
    for dtype, heads, kv_heads, dim in cases:
        for batch, context in ((1, 128), (1, 4096), (1, 8192), (8, 512), (32, 192), (8, 8192)):
            width = context // 16
            blocks = batch * width
            k = torch.randn(blocks, 16, kv_heads, dim).to(dtype)
            v = torch.randn(blocks, 16, kv_heads, dim).to(dtype)
            tables = torch.arange(blocks).view(batch, width).int()
            q = torch.randn(batch, heads, dim).to(dtype)
            starts, ends = torch.zeros(batch).int(), torch.full((batch,), context).int()
            kernel = timed(paged_decode, q, k, v, tables, starts, ends)
            scored = timed(paged_decode, q, k, v, tables, starts, ends, want_weights=True)
            reference = timed(paged_decode_reference, q, k, v, tables, starts, ends)
            gbps = 2 * k.numel() * k.element_size() / kernel / 1e3
            shape = f"{heads}/{kv_heads} x {dim}"
            print(f"| {str(dtype)[6:]} | {shape} | {batch} | {context} | {kernel:.0f} | {gbps:.1f} | {scored:.0f} | "
                  f"{reference:.0f} | {reference / kernel:.1f}x |")  # fmt: skip

if __name__ == "__main__":
    main()
