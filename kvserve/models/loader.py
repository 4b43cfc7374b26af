"""Load a model and its tokenizer from a GGUF file or a Hugging Face folder; find the default model."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from kvserve.errors import ModelLoadError
from kvserve.log import get_logger
from kvserve.models import gguf_file
from kvserve.models.batch_invariant import make_batch_invariant
from kvserve.models.catalog import resolve_model_path
from kvserve.models.config import ModelConfig
from kvserve.models.gguf_linear import GGUFEmbedding, GGUFLinear
from kvserve.models.int8_activations import use_int8_activations
from kvserve.models.llama import LlamaForCausalLM
from kvserve.models.quant_linear import Q8Linear, QuantEmbedding, QuantLinear, max_rows
from kvserve.models.sharding import TensorShard, check_shardable, shard_config, shard_sources
from kvserve.models.tokenizer_override import TokenizerOverride
from kvserve.models.weights import build_model
from kvserve.platform.cpu_kernels import cpu_kernels_available, prepare_cpu_kernels
from kvserve.text.tokenizer import Tokenizer

Progress = Callable[[int, int], None]
# native: Q4_0/Q4_1 weights run as int4 for small batches (decode), a dequantised copy for larger ones;
# int4: int4 only (a quarter of bfloat16's memory, slow prefill); dequant: every tensor dequantised.
WEIGHT_MODES = ("native", "int4", "dequant")
# Activation dtypes that run int4 weights natively: bfloat16 through torch's int4 kernel, float32 through
# kvserve's (csrc/quant_gemv.cpp; torch's takes float32 too, ~20x slower than a dense float32 matmul).
# float32 stays exact: the same weights, only the order of a row's sums differs from the dense matmul.
NATIVE_INT4_DTYPES = (torch.bfloat16, torch.float32)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path
    dtype: torch.dtype
    weights: str = "dequant"  # what runs: "native", "int4" (some weights as int4) or "dequant"
    weights_summary: str = ""  # per tensor type, how it runs (for logs and reports)
    batch_invariant: bool = False  # matmuls whose result for a row does not depend on the others (batch_invariant.py)
    int8_activations: bool = False  # the 4-bit projections round float32 activations to int8 (int8_activations.py)
    # Tensor parallelism: this process's share of the weights; ``config`` stays the whole model's, while
    # ``model.config`` is the share it computes (its heads, its part of the MLP).
    shard: TensorShard | None = None


def load_model(
    path: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    progress: Progress | None = None,
    weights: str = "native",
    batch_invariant: bool = False,
    tokenizer: str | None = None,
    chat_template: str | None = None,
    shard: TensorShard | None = None,
    int8_activations: bool = False,
) -> LoadedModel:
    """Load ``path`` (a .gguf file or a folder with config.json + *.safetensors + tokenizer.json).

    ``None`` loads the default model; a shipped model's short name (``models/catalog.py``) loads that one.
    ``progress(done, total)`` is called per tensor.
    ``weights="native"`` runs a GGUF file's Q4_K / Q5_K / Q6_K / Q5_0 / Q8_0 matrices on the file's blocks on CPU
    (``models/gguf_linear.py``; not on other devices or in a tensor-parallel shard), and its Q4_0 / Q4_1 projections
    (and a tied Q8_0 head) on their codes
    when ``dtype`` is bfloat16 or float32 on CPU, for batches of up to ``quant_linear.max_rows(dtype)`` rows,
    and a dequantised copy for larger ones;
    ``"int4"`` keeps the int4 form only (other types, dtypes and devices are dequantised, and the log
    says so); ``"dequant"`` dequantises every tensor to ``dtype``.
    ``batch_invariant`` switches the matmuls to row-invariant kernels (``models/batch_invariant.py``): int4
    for every batch size, no dequantised copies, dense weights in fixed row tiles.
    ``tokenizer`` (a folder, tokenizer.json or GGUF) and ``chat_template`` (a Jinja file or inline template)
    replace the model's own; both are read, and the template compiled, before the weights load.
    ``shard`` loads one tensor-parallel rank's share of every layer (``models/sharding.py``).
    ``int8_activations`` rounds the float32 activations of the 4-bit projections to int8
    (``models/int8_activations.py``; lossy, faster than float32 at every batch size, so no dense copy of them is
    made); a model without such projections is refused.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {weights!r}")
    path = resolve_model_path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    prepare_cpu_kernels(device)  # built (first time, logged) or loaded now, not in a request
    override = TokenizerOverride.read(tokenizer, chat_template)
    if path.is_dir():
        model, tokenizer = _load_hf_folder(path, dtype, progress, shard)
        summary = f"safetensors weights as {_dtype_name(dtype)}"
    else:
        refusal = _int4_refusal(weights, dtype, device)
        # With int8 activations the codes beat a dense copy at every batch size: none is made.
        int4_dense = weights == "native" and not batch_invariant and not int8_activations
        blocks = _blocks_allowed(weights, device, shard)
        model, tokenizer, summary = _load_gguf(
            path, dtype, progress, refusal, int4_dense, max_rows(dtype), shard, blocks
        )
    config = model.config if shard is None else read_model_config(path)
    tokenizer = override.apply(tokenizer, model.config.vocab_size)
    quantised = any(
        isinstance(m, (QuantLinear, QuantEmbedding, Q8Linear, GGUFLinear, GGUFEmbedding)) for m in model.modules()
    )
    mode = weights if quantised else "dequant"
    model = model.to(device)
    model.prepack()
    if batch_invariant:
        make_batch_invariant(model)
        summary += "; batch-invariant: one kernel for every row count"
    if int8_activations:
        switched = use_int8_activations(model)
        head = model._modules.get("lm_head")
        summary += f"; int8 activations in the {switched} 4-bit projections"
        summary += " and the Q8_0 head" if getattr(head, "int8_activations", False) else ""
    get_logger().info("loaded %s: %s, weights %s (%s)", path.name, _dtype_name(dtype), mode, summary)
    if shard is not None:
        summary += f"; tensor-parallel rank {shard.rank} of {shard.size}"
    return LoadedModel(model, tokenizer, config, path, dtype, mode, summary, batch_invariant, int8_activations, shard)


def _blocks_allowed(weights: str, device: torch.device | str, shard: TensorShard | None) -> bool:
    """Whether K-quant / Q5_0 / Q8_0 matrices run on their blocks (``models/gguf_linear.py``) instead of being
    dequantised: on CPU with kvserve's kernels, unless ``weights="dequant"`` or the model is sharded (a row-parallel
    shard would cut superblocks)."""
    return weights != "dequant" and torch.device(device).type == "cpu" and shard is None and cpu_kernels_available()


def _int4_refusal(weights: str, dtype: torch.dtype, device: torch.device | str) -> str | None:
    """Why Q4 weights cannot run as int4 here, or None when they can."""
    if weights == "dequant":
        return "weights=dequant"
    if torch.device(device).type != "cpu":
        return f"native int4 runs on CPU only, not {device}"
    if dtype not in NATIVE_INT4_DTYPES:
        return f"native int4 needs bfloat16 or float32 activations, not {_dtype_name(dtype)}"
    if dtype == torch.float32 and not cpu_kernels_available():
        return "native int4 in float32 needs kvserve's CPU kernels, which are not available"
    return None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_gguf(
    path: Path,
    dtype: torch.dtype,
    progress: Progress | None,
    int4_refusal: str | None,
    int4_dense: bool,
    codes_rows: int,
    shard: TensorShard | None,
    blocks: bool,
) -> tuple[LlamaForCausalLM, Tokenizer, str]:
    reader = gguf_file.open_gguf(path)
    config = gguf_file.read_config(reader)
    tokenizer = Tokenizer.from_gguf(reader)
    sources = gguf_file.tensor_sources(reader, config)
    int4 = gguf_file.int4_sources(reader, config)
    refused = f"; Q4 dequantised: {int4_refusal}" if int4 and int4_refusal else ""
    if int4_refusal:
        int4 = {}
    if shard is not None:
        check_shardable(config, shard.size, int4=bool(int4))
        sources, int4 = shard_sources(config, sources, shard), shard_sources(config, int4, shard)
        config = shard_config(config, shard)
    ran_int4: set[str] = set()  # a Q4 tensor fused with a non-Q4 one is dequantised: record what ran as int4
    int4 = {name: _recorded(source, name, ran_int4) for name, source in int4.items()}
    native = gguf_file.native_sources(reader, config) if blocks else {}
    if int4:  # a Q4_0 / Q4_1 file keeps its tied Q8_0 head on Q8Linear (head_q8), as before blocks ran natively
        native.pop("model.embed_tokens.weight", None)
    ran_blocks: set[str] = set()
    native = {name: _recorded(source, name, ran_blocks) for name, source in native.items()}
    head_q8 = None if int4_refusal or "model.embed_tokens.weight" in native else gguf_file.embedding_q8_0(reader)
    model = build_model(
        config, sources, dtype, gguf_file.rope_freq_factors(reader), progress, int4, int4_dense, head_q8, native
    )
    summary = _weights_summary(gguf_file.tensor_type_names(reader), ran_int4, ran_blocks, dtype)
    if isinstance(model._modules.get("lm_head"), Q8Linear):
        summary += "; tied head reads the Q8_0 codes"
    if ran_int4 and int4_dense:
        summary += f"; int4 for batches of up to {codes_rows} rows, a {_dtype_name(dtype)} copy above"
    return model, tokenizer, summary + refused


def _recorded(source: Callable[[], object], name: str, names: set[str]) -> Callable[[], object]:
    def get() -> object:
        names.add(name)
        return source()

    return get


def _weights_summary(types: dict[str, str], int4: set[str], blocks: set[str], dtype: torch.dtype) -> str:
    """E.g. "210 Q4_1 as int4, 61 F32 + 1 Q8_0 as bfloat16", or "112 Q4_K + 29 Q6_K on their blocks, ..."."""
    counts: dict[tuple[str, str], int] = {}
    for name, kind in types.items():
        key = (kind, "int4" if name in int4 else "blocks" if name in blocks else "dense")
        counts[key] = counts.get(key, 0) + 1

    def listed(how: str) -> str:
        return " + ".join(f"{n} {kind}" for (kind, h), n in sorted(counts.items()) if h == how)

    parts = [f"{listed('int4')} as int4"] if listed("int4") else []
    parts += [f"{listed('blocks')} on their blocks"] if listed("blocks") else []
    parts += [f"{listed('dense')} as {_dtype_name(dtype)}"] if listed("dense") else []
    return ", ".join(parts)


def read_model_config(model: str | Path | None) -> ModelConfig:
    """A model's architecture from its metadata only (GGUF header or config.json), without its weights."""
    path = resolve_model_path(model)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    return _read_hf_config(path) if path.is_dir() else gguf_file.read_config(gguf_file.open_gguf(path))


def _read_hf_config(path: Path) -> ModelConfig:
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{path} has no config.json (expected a Hugging Face model folder or a .gguf file)")
    try:
        return ModelConfig.from_hf_config(json.loads(config_path.read_text()))
    except (json.JSONDecodeError, KeyError) as exc:
        raise ModelLoadError(f"{config_path} is not a usable model config: {exc!r}") from exc


def _load_hf_folder(
    path: Path, dtype: torch.dtype, progress: Progress | None, shard: TensorShard | None
) -> tuple[LlamaForCausalLM, Tokenizer]:
    config = _read_hf_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    tokenizer = Tokenizer.from_hf_folder(path)
    sources = {}
    for file in files:
        try:
            handle = safe_open(str(file), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"{file} is truncated or corrupt: {exc}") from exc
        for name in handle.keys():
            sources[name] = _safetensors_getter(handle, name)
    # Hugging Face stores Gemma's norm weights as w; the model keeps 1 + w
    if config.architecture in ("gemma2", "gemma3"):
        sources = {name: _plus_one(get) if name.endswith("norm.weight") else get for name, get in sources.items()}
    if "lm_head.weight" not in sources and not config.tie_word_embeddings:
        raise ModelLoadError(f"{path}: config says untied embeddings but there is no lm_head.weight")
    if shard is not None:
        check_shardable(config, shard.size)
        sources, config = shard_sources(config, sources, shard), shard_config(config, shard)
    return build_model(config, sources, dtype, progress=progress), tokenizer


def _plus_one(source: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    return lambda: source() + 1


def _safetensors_getter(handle: object, name: str) -> Callable[[], torch.Tensor]:
    def get() -> torch.Tensor:
        try:
            return handle.get_tensor(name).float()
        except SafetensorError as exc:
            raise ModelLoadError(f"tensor {name} could not be read: {exc}") from exc

    return get
