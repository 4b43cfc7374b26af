"""Decode attention over an int8 and an int4 KV cache (``paged_decode_quant``, the rows read in place) against the
bfloat16 cache's kernel (``paged_decode`` with bfloat16 queries): one layer's call at 8,192 keys, batch 1 and 8,
SmolLM2's heads (9 query, 3 KV, head dim 64), blocks of 16 in shuffled order.

Two settings:
- ``model``: 30 layers (SmolLM2-135M's), each its own cache, one call each, as in a decode step: the keys come from
  memory (a model's KV is many times the last-level cache);
- ``one cache``: one layer's call repeated over the same cache, which at batch 1 stays in the CPU's caches (what
  a loop over a single layer measures; not a model's step).
Rounds alternate the formats (a shared VM's speed drifts); each round keeps a format's fastest of 3 passes of 30
calls, and the table shows the median over rounds per call.

    python benchmarks/kv_quant/decode_kernel.py [threads] [rounds]
"""

import gc
import statistics
import sys
import time

import torch

from kvserve.attention.decode import paged_decode
from kvserve.attention.kv_quant import KVQuant
from kvserve.platform.machine import describe_machine, machine_line

LAYERS, CONTEXT, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 30, 8192, 16, 9, 3, 64
FORMATS = ("bfloat16", "int8", "int4")


def caches(batch: int, gen: torch.Generator) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Each format's (keys, values) per layer, from the same random values."""
    blocks = batch * CONTEXT // BLOCK
    quants = {name: KVQuant(name, HEAD_DIM) for name in ("int8", "int4")}
    out: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {name: [] for name in FORMATS}
    for _ in range(LAYERS):
        k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
        out["bfloat16"].append((k.bfloat16(), v.bfloat16()))
        for name, quant in quants.items():
            out[name].append((quant.quantize(quant.rotated(k)), quant.quantize(quant.rotated(v))))
    return out


def measure(batch: int, rounds: int, gen: torch.Generator) -> None:
    """Prints the table's rows for one batch size."""
    kv = caches(batch, gen)
    quants = {name: KVQuant(name, HEAD_DIM) for name in ("int8", "int4")}
    width = CONTEXT // BLOCK
    tables = torch.randperm(batch * width, generator=gen).view(batch, width).int()
    starts, ends = torch.zeros(batch, dtype=torch.int32), torch.full((batch,), CONTEXT, dtype=torch.int32)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen)
    queries = {"bfloat16": q.bfloat16(), "int8": q, "int4": q}

    def step(name: str, layers: list[int]) -> float:
        """Seconds per call over these layers' caches."""
        start = time.perf_counter()
        for layer in layers:
            k, v = kv[name][layer]
            paged_decode(queries[name], k, v, tables, starts, ends, quant=quants.get(name))
        return (time.perf_counter() - start) / len(layers)

    for setting, layers in (("model", list(range(LAYERS))), ("one cache", [0] * LAYERS)):
        times: dict[str, list[float]] = {name: [] for name in FORMATS}
        gc.disable()
        for name in FORMATS:
            step(name, layers)  # warm-up
        for _ in range(rounds):
            for name in FORMATS:
                times[name].append(min(step(name, layers) for _ in range(3)))
        gc.enable()
        base = statistics.median(times["bfloat16"])
        for name in FORMATS:
            seconds = statistics.median(times[name])
            k, v = kv[name][0]
            gbps = (k.nbytes + v.nbytes) / seconds / 1e9
            print(f"| {setting} | {batch} | {name} | {seconds * 1e3:.3f} | {gbps:.1f} | {base / seconds:.2f}x |")


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    gen = torch.Generator().manual_seed(0)
    print(f"{machine_line(describe_machine())}, {torch.get_num_threads()} threads\n")
    print("| setting | batch | KV format | ms per call | KV GB/s | vs bfloat16 |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for batch in (1, 8):
        measure(batch, rounds, gen)


if __name__ == "__main__":
    main()
