"""Micro benchmark: one decode step of attention (all layers) through the paged and the contiguous cache.

Each step writes one new key/value per sequence and attends over ``--context`` cached tokens, with
the default model's attention shape (30 layers, 9 query heads, 3 KV heads, head dim 64). The paged
cache uses shuffled (non-contiguous) block tables; its metadata is built once per step and its
cost is shown separately. Paged and contiguous alternate rep by rep, so a noisy neighbour hits
both; read the ratio, not the absolute times.

    .venv/bin/python benchmarks/paged_attention_decode.py [--threads 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time
from collections.abc import Callable

import torch

from kvserve.attention import AttentionMetadata, ContiguousKVCache, PagedAttentionMetadata, PagedKVCache
from kvserve.platform.machine import describe_machine


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512, help="cached tokens per sequence before the step")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None, help="also write the results here")
    return p.parse_args()


def run_steps(backend: object, meta: AttentionMetadata, q: torch.Tensor, kv: torch.Tensor, layers: int) -> None:
    for layer in range(layers):
        backend.forward(layer, q, kv, kv, meta)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_batch(args: argparse.Namespace, batch: int, dtype: torch.dtype) -> dict[str, float]:
    ctx, bs = args.context, args.block_size
    blocks_per_seq = math.ceil((ctx + 1) / bs)
    num_blocks = batch * blocks_per_seq
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)
    tables = [ids[i * blocks_per_seq : (i + 1) * blocks_per_seq] for i in range(batch)]
    paged = PagedKVCache(args.layers, num_blocks, bs, args.kv_heads, args.head_dim, dtype)
    contiguous = ContiguousKVCache(args.layers, batch, args.kv_heads, args.head_dim, ctx + 1, dtype)
    for cache in (paged.k, paged.v, contiguous.k, contiguous.v):
        cache.normal_()
    seqs, q_lens, ctx_lens = list(range(batch)), [1] * batch, [ctx] * batch

    def build() -> PagedAttentionMetadata:
        return PagedAttentionMetadata.build(seqs, q_lens, ctx_lens, tables, bs)

    ref_meta = AttentionMetadata(seq_ids=tuple(seqs), query_lens=tuple(q_lens), context_lens=tuple(ctx_lens))
    q = torch.randn(batch, args.heads, args.head_dim, dtype=dtype)
    kv = torch.randn(batch, args.kv_heads, args.head_dim, dtype=dtype)
    times: dict[str, list[float]] = {"paged": [], "contiguous": [], "metadata": []}
    with torch.inference_mode():
        for rep in range(args.reps + 2):  # two warm-up reps
            t_meta = timed(build)
            meta = build()
            t_paged = timed(lambda meta=meta: run_steps(paged, meta, q, kv, args.layers))
            t_ref = timed(lambda: run_steps(contiguous, ref_meta, q, kv, args.layers))
            if rep >= 2:
                times["metadata"].append(t_meta)
                times["paged"].append(t_paged)
                times["contiguous"].append(t_ref)
    return {name: statistics.median(values) * 1e3 for name, values in times.items()}


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    machine = describe_machine()
    rows = []
    for batch in args.batch_sizes:
        r = bench_batch(args, batch, dtype)
        rows.append({"batch": batch, **r, "paged_over_contiguous": r["paged"] / r["contiguous"]})
    print(
        f"decode step, attention only: {args.layers} layers, heads {args.heads}/{args.kv_heads}, head dim "
        f"{args.head_dim}, context {args.context}, block size {args.block_size}, {args.dtype}, "
        f"median of {args.reps} reps"
    )
    print(
        f"machine: {machine['cpu']}, {machine['nproc']} CPUs, {machine['memory_gib']} GiB, torch {machine['torch']} "
        f"({machine['cpu_capability']}), {torch.get_num_threads()} threads"
    )
    print()
    print("| batch | paged (ms) | contiguous (ms) | paged / contiguous | paged metadata build (ms) |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(
            f"| {r['batch']} | {r['paged']:.2f} | {r['contiguous']:.2f} | {r['paged_over_contiguous']:.2f}x "
            f"| {r['metadata']:.3f} |"
        )
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        with open(args.json, "w") as f:
            json.dump({"settings": settings, "machine": machine, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
