"""Write a random-weight mixture-of-experts GGUF with a real model's shapes, then quantise it with llama.cpp's own
quantizer, so kvserve and llama.cpp read one identical file. Speed and memory do not depend on the weights' values.

    python benchmarks/moe/make_moe_gguf.py --out /tmp/olmoe-shaped [--llamacpp-python PATH]

Shapes are OLMoE-1B-7B's (16 layers, hidden 2,048, 16 heads of 128, 64 experts of 1,024, 8 per token: ~6.9B
parameters, ~1.3B active) in the ``qwen3moe`` architecture (q/k norms, top-k softmax routing renormalised). The
tokenizer is SmolLM2's (49,152 tokens, from the shipped model) instead of OLMoE's 50,304. Tensors are written one at
a time (a 7B model never sits in memory) as F16, then ``llama_model_quantize`` makes the Q4_K_M file in a separate
interpreter that has ``llama_cpp`` (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

OLMOE = dict(hidden=2048, layers=16, heads=16, kv_heads=16, head_dim=128, experts=64, used=8, expert_ff=1024)

QUANTIZE = """
import sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
params.nthread = int(sys.argv[3])
rc = llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params)
sys.exit(rc)
"""


def tokenizer_fields(source: Path) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """The ``tokenizer.*`` fields of ``source`` as (key, value, type, array item type)."""
    reader = gguf.GGUFReader(source)
    fields = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = field.types[0]
        item = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
        fields.append((key, field.contents(), kind, item))
    return fields


def attention_shapes(i: int, h: int, q: int, kv: int) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s attention norm and q/k/v/output matrices (hidden ``h``, ``q`` query and ``kv`` key/value rows)."""
    return {
        f"blk.{i}.attn_norm.weight": (h,),
        f"blk.{i}.attn_q.weight": (q, h),
        f"blk.{i}.attn_k.weight": (kv, h),
        f"blk.{i}.attn_v.weight": (kv, h),
        f"blk.{i}.attn_output.weight": (h, q),
    }


def tensor_shapes(shape: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    """llama.cpp tensor name -> numpy shape (rows last-but-one, as ``gguf`` writes them)."""
    h, q, kv = shape["hidden"], shape["heads"] * shape["head_dim"], shape["kv_heads"] * shape["head_dim"]
    e, ff = shape["experts"], shape["expert_ff"]
    shapes = {"token_embd.weight": (vocab, h), "output_norm.weight": (h,), "output.weight": (vocab, h)}
    for i in range(shape["layers"]):
        shapes |= attention_shapes(i, h, q, kv)
        shapes |= {
            f"blk.{i}.attn_q_norm.weight": (shape["head_dim"],),
            f"blk.{i}.attn_k_norm.weight": (shape["head_dim"],),
            f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.ffn_gate_inp.weight": (e, h),
            f"blk.{i}.ffn_gate_exps.weight": (e, ff, h),
            f"blk.{i}.ffn_up_exps.weight": (e, ff, h),
            f"blk.{i}.ffn_down_exps.weight": (e, h, ff),
        }
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Norms 1, the router wide enough that routing varies by token, the rest ~N(0, 1/fan_in)."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32)
    scale = (4.0 if "gate_inp" in name else 1.0) / np.sqrt(shape[-1])
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(np.float16)


def write_f16(path: Path, shape: dict, tokenizer_source: Path, context: int) -> None:
    fields = tokenizer_fields(tokenizer_source)
    vocab = len(next(value for key, value, *_ in fields if key == "tokenizer.ggml.tokens"))
    writer = gguf.GGUFWriter(path, "qwen3moe")
    writer.add_name("olmoe-shaped-random")
    writer.add_context_length(context)
    writer.add_embedding_length(shape["hidden"])
    writer.add_block_count(shape["layers"])
    writer.add_feed_forward_length(shape["expert_ff"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_expert_count(shape["experts"])
    writer.add_expert_used_count(shape["used"])
    writer.add_expert_feed_forward_length(shape["expert_ff"])
    writer.add_vocab_size(vocab)
    for key, value, kind, item in fields:
        writer.add_key_value(key, value, kind, sub_type=item)
    shapes = tensor_shapes(shape, vocab)
    write_streaming(writer, shapes, random_tensor)


def write_streaming(
    writer: gguf.GGUFWriter,
    shapes: dict[str, tuple[int, ...]],
    make: Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray],
    every: int = 24,
) -> None:
    """Write the header, then each tensor as ``make(name, shape, rng)`` makes it, one at a time (vectors F32,
    matrices F16): the model never sits in memory. ``writer`` holds the metadata already."""
    for name, dims in shapes.items():
        dtype = np.dtype(np.float32 if len(dims) == 1 else np.float16)
        writer.add_tensor_info(name, dims, dtype, int(np.prod(dims)) * dtype.itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    start = time.time()
    for i, (name, dims) in enumerate(shapes.items()):
        writer.write_tensor_data(make(name, dims, rng))
        if i % every == 0 or i == len(shapes) - 1:
            print(f"  {i + 1}/{len(shapes)} tensors written ({time.time() - start:.0f} s)", file=sys.stderr, flush=True)
    writer.close()


def quantize_q4_k_m(python: str, f16: Path, out: Path, threads: int) -> None:
    """llama.cpp's own ``llama_model_quantize`` (default parameters, Q4_K_M) under ``python``, which has llama_cpp."""
    start = time.time()
    subprocess.run([python, "-c", QUANTIZE, str(f16), str(out), str(threads)], check=True)
    print(f"  quantised in {time.time() - start:.0f} s", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the F16 and Q4_K_M files")
    parser.add_argument("--llamacpp-python", default=sys.executable, help="interpreter with llama_cpp")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file (~14 GB)")
    args = parser.parse_args()
    from kvserve.models.catalog import resolve_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    f16, q4 = args.out / "olmoe-shaped-F16.gguf", args.out / "olmoe-shaped-Q4_K_M.gguf"
    print(f"writing {f16}", file=sys.stderr)
    write_f16(f16, OLMOE, resolve_model_path(None), args.context)
    print(f"quantising to {q4} with llama.cpp", file=sys.stderr)
    quantize_q4_k_m(args.llamacpp_python, f16, q4, args.threads)
    if not args.keep_f16:
        f16.unlink()
    print(q4)


if __name__ == "__main__":
    main()
