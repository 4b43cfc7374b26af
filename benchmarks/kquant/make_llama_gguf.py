"""Write random-weight GGUF files with the exact shapes and metadata of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B,
then quantise them to Q4_K_M with llama.cpp's own quantizer, so kvserve and llama.cpp read one identical file of a
real model's size without downloading it. Speed and memory do not depend on the weights' values.

    python benchmarks/kquant/make_llama_gguf.py --out /work/kq-models --models 1b,3b \\
        --llamacpp-python PATH/TO/python-with-llama_cpp

Each model is written as llama.cpp's ``convert_hf_to_gguf.py`` writes the real one: architecture ``llama``, Q/K rows
in llama.cpp's layout (random, so the permutation is moot), 8 KV heads, ``rope_freqs.weight`` for the llama3 rope
scaling (``tests/gguf_convert.py``'s ``llama3_rope_factors``), no ``output.weight`` where the embeddings are tied (1B,
3B). The tokenizer is SmolLM2's byte-level BPE (GPT-2 style, from the shipped default model, as
``benchmarks/moe/make_moe_gguf.py`` uses) padded with plain tokens to Llama 3's 128,256 entries, so the embedding
and the head are the real size; the padding is never produced by the merges. Tensors are written one at a time as
F16 (norms 1, matrices ~N(0, 1/fan_in), so activations stay finite), then ``llama_model_quantize`` (default
parameters, ``LLAMA_FTYPE_MOSTLY_Q4_K_M``) makes ``NAME-Q4_K_M.gguf`` in a separate interpreter that has
``llama_cpp``; the F16 intermediate (2.5 / 6.4 / 16 GB) is deleted unless ``--keep-f16``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # this checkout's kvserve, tests and benchmarks, however the script is started

from benchmarks.moe.make_moe_gguf import (  # noqa: E402
    attention_shapes,
    quantize_q4_k_m,
    tokenizer_fields,
    write_streaming,
)
from tests.gguf_convert import llama3_rope_factors  # noqa: E402

LLAMA3_VOCAB = 128256
# Hugging Face config.json values of the released models (the fields the GGUF converter reads).
_ROPE_3_2 = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0)
_ROPE_3_1 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0)
MODELS = {
    "1b": dict(
        name="Llama-3.2-1B", hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
        head_dim=64, intermediate_size=8192, tie_word_embeddings=True, rope=_ROPE_3_2,
    ),
    "3b": dict(
        name="Llama-3.2-3B", hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
        head_dim=128, intermediate_size=8192, tie_word_embeddings=True, rope=_ROPE_3_2,
    ),
    "8b": dict(
        name="Llama-3.1-8B", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
        head_dim=128, intermediate_size=14336, tie_word_embeddings=False, rope=_ROPE_3_1,
    ),
}  # fmt: skip
ROPE_THETA = 500000.0
ORIGINAL_CONTEXT = 8192
CONTEXT = 131072
RMS_EPS = 1e-5


def hf_config(cfg: dict) -> dict:
    """The model's Hugging Face ``config.json`` fields, as ``llama3_rope_factors`` reads them."""
    rope = cfg["rope"] | dict(rope_theta=ROPE_THETA, original_max_position_embeddings=ORIGINAL_CONTEXT)
    return dict(
        hidden_size=cfg["hidden_size"], num_attention_heads=cfg["num_attention_heads"], head_dim=cfg["head_dim"],
        rope_scaling=rope, rope_theta=ROPE_THETA,
    )  # fmt: skip


def tensor_shapes(cfg: dict, vocab: int) -> dict[str, tuple[int, ...]]:
    """llama.cpp tensor name -> numpy shape (rows first), in the converter's order."""
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"rope_freqs.weight": (cfg["head_dim"] // 2,), "token_embd.weight": (vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        shapes |= attention_shapes(i, h, q, kv)
        shapes |= {
            f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.ffn_gate.weight": (ff, h),
            f"blk.{i}.ffn_up.weight": (ff, h),
            f"blk.{i}.ffn_down.weight": (h, ff),
        }
    shapes["output_norm.weight"] = (h,)
    if not cfg["tie_word_embeddings"]:
        shapes["output.weight"] = (vocab, h)
    return shapes


def padded_tokenizer(source: Path, vocab: int) -> list[tuple[str, object, gguf.GGUFValueType, object]]:
    """``source``'s tokenizer fields with its token list (and token types) padded to ``vocab`` plain tokens."""
    fields = tokenizer_fields(source)
    out = []
    for key, value, kind, item in fields:
        if key == "tokenizer.ggml.tokens":
            if len(value) > vocab:
                raise ValueError(f"{source.name} has {len(value)} tokens, more than {vocab}")
            value = list(value) + [f"<pad_{i}>" for i in range(len(value), vocab)]
        elif key == "tokenizer.ggml.token_type":
            value = list(value) + [int(gguf.TokenType.NORMAL)] * (vocab - len(value))
        out.append((key, value, kind, item))
    return out


def write_f16(path: Path, cfg: dict, tokenizer_source: Path) -> None:
    rope_factors = llama3_rope_factors(hf_config(cfg))["rope_freqs.weight"]

    def make(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
        if name == "rope_freqs.weight":
            return rope_factors
        if len(shape) == 1:
            return np.ones(shape, dtype=np.float32)
        return (rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(shape[-1]))).astype(np.float16)

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"{cfg['name']}-shaped-random")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_key_length(cfg["head_dim"])
    writer.add_value_length(cfg["head_dim"])
    writer.add_vocab_size(LLAMA3_VOCAB)
    writer.add_rope_dimension_count(cfg["head_dim"])
    for key, value, kind, item in padded_tokenizer(tokenizer_source, LLAMA3_VOCAB):
        writer.add_key_value(key, value, kind, sub_type=item)
    write_streaming(writer, tensor_shapes(cfg, LLAMA3_VOCAB), make)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for the files (F16 while quantising)")
    parser.add_argument("--models", default="1b,3b", help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--llamacpp-python", default=sys.executable, help="interpreter with llama_cpp")
    parser.add_argument("--threads", type=int, default=2, help="the quantizer's threads")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 files")
    args = parser.parse_args()
    from kvserve.models.catalog import resolve_model_path

    names = [m for m in args.models.split(",") if m]
    unknown = set(names) - set(MODELS)
    if unknown:
        raise SystemExit(f"--models: unknown {sorted(unknown)}; choose from {', '.join(MODELS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for key in names:
        cfg = MODELS[key]
        f16, q4 = args.out / f"{cfg['name']}-shaped-F16.gguf", args.out / f"{cfg['name']}-shaped-Q4_K_M.gguf"
        params = sum(int(np.prod(s)) for s in tensor_shapes(cfg, LLAMA3_VOCAB).values())
        free = shutil.disk_usage(args.out).free
        print(f"{cfg['name']}: {params / 1e9:.2f}B parameters, F16 {params * 2 / 1e9:.1f} GB, "
              f"{free / 1e9:.0f} GB free", file=sys.stderr, flush=True)  # fmt: skip
        if free < params * 2 * 1.35:  # the F16 file and the Q4_K_M file beside it
            raise SystemExit(f"not enough disk in {args.out} for {cfg['name']}")
        start = time.time()
        print(f"writing {f16}", file=sys.stderr, flush=True)
        write_f16(f16, cfg, resolve_model_path(None))
        print(f"quantising to {q4} with llama.cpp", file=sys.stderr, flush=True)
        quantize_q4_k_m(args.llamacpp_python, f16, q4, args.threads)
        if not args.keep_f16:
            f16.unlink()
        print(f"  {q4.stat().st_size / 1e9:.2f} GB in {time.time() - start:.0f} s", file=sys.stderr, flush=True)
        print(q4, flush=True)


if __name__ == "__main__":
    main()
