"""Decode attention of a float32 model over a float32, bfloat16 and float16 cache (``kv_cache_dtype``): one
token's 30 layers (SmolLM2: 9 query heads, 3 KV heads, head dim 64, blocks of 16) after 4,096 tokens, each
layer its own 6.3 MB (float32) cache, as in the model, so the keys come from memory, not the caches.
Rounds alternate the dtypes (a shared VM's speed drifts); each round keeps its fastest of 3 tokens.

    python benchmarks/decode-kernel/narrow_cache.py [threads] [rounds]
"""

import statistics
import sys
import time

import torch

from kvserve.attention.decode import paged_decode

LAYERS, CONTEXT, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 30, 4096, 16, 3, 64, 9


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    gen = torch.Generator().manual_seed(0)
    blocks = CONTEXT // BLOCK
    keys = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    values = [torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(LAYERS)]
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    caches = {dt: ([k.to(dt) for k in keys], [v.to(dt) for v in values]) for dt in dtypes}
    q = torch.randn(1, HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(blocks, generator=gen).int()[None]
    starts, ends = torch.tensor([0], dtype=torch.int32), torch.tensor([CONTEXT], dtype=torch.int32)

    def token(dtype: torch.dtype) -> float:
        ks, vs = caches[dtype]
        start = time.perf_counter()
        for layer in range(LAYERS):
            paged_decode(q, ks[layer], vs[layer], tables, starts, ends)
        return time.perf_counter() - start

    times: dict[torch.dtype, list[float]] = {dt: [] for dt in dtypes}
    for dt in dtypes:
        token(dt)  # warm-up
    for _ in range(rounds):
        for dt in dtypes:
            times[dt].append(min(token(dt) for _ in range(3)))
    base = statistics.median(times[torch.float32])
    print(f"| cache dtype | ms per token ({LAYERS} layers, {CONTEXT} keys) | KV GB/s | vs float32 |")
    print("| --- | ---: | ---: | ---: |")
    for dt in dtypes:
        ms = statistics.median(times[dt])
        nbytes = 2 * LAYERS * CONTEXT * KV_HEADS * HEAD_DIM * torch.empty((), dtype=dt).element_size()
        print(f"| {str(dt).removeprefix('torch.')} | {ms * 1e3:.1f} | {nbytes / ms / 1e9:.1f} | {base / ms:.2f}x |")


if __name__ == "__main__":
    main()
