"""The model options every ``kvserve`` command shares, and the model they load.

``generate``, ``serve``, ``bench`` and ``eval`` import these from here; ``entrypoints/cli.py`` imports the
subcommands to register them, so the shared pieces live below it.
"""

from __future__ import annotations

import argparse

import torch

from kvserve.config import WEIGHT_MODES
from kvserve.entrypoints.progress import DelayedProgress
from kvserve.errors import KVServeError
from kvserve.models.dtype import DTYPE_CHOICES, DTYPES
from kvserve.models.loader import LoadedModel, load_model
from kvserve.models.sharding import TensorShard
from kvserve.platform.devices import check_device


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=None, help="GGUF file, Hugging Face folder, a Hugging Face name in the local cache "
        "(org/name) or a shipped model (smollm2-135m, gemma3-270m) (default: SmolLM2-135M-Instruct)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=DTYPE_CHOICES, default="auto",
        help="weights and activations dtype (auto: bfloat16 on CUDA or a CPU with AMX/avx512_bf16, else float32)",
    )  # fmt: skip
    parser.add_argument(
        "--weights", choices=WEIGHT_MODES, default="native",
        help="GGUF weights: native runs Q4_0/Q4_1 on their 4-bit codes for decode-sized batches (CPU: bfloat16 up "
        "to 3 rows, float32 up to 16) and a dequantised copy above, int4 keeps only the codes, dequant dequantises "
        "all",
    )  # fmt: skip
    parser.add_argument(
        "--int8-activations", action="store_true",
        help="round the float32 activations of the 4-bit projections and a Q8_0 head to int8 (lossy, like "
        "llama.cpp; ~1.5x faster at one sequence, ~2-3x at 32, no dense copy of them); needs --dtype float32 and "
        "native or int4 weights",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda[:N]")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def check_model_args(args: argparse.Namespace) -> None:
    """What every command's model options must be, checked before anything loads."""
    check_device(args.device)
    if getattr(args, "threads", None) is not None and args.threads < 1:
        raise KVServeError(f"--threads must be >= 1, got {args.threads}")


def load_from_args(args: argparse.Namespace) -> LoadedModel:
    """The model, or with ``--tensor-parallel-size`` N rank 0's share of it (the engine starts the others)."""
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    size = getattr(args, "tensor_parallel_size", 1)
    with DelayedProgress("Loading model") as progress:
        return load_model(
            args.model, DTYPES[args.dtype], args.device, progress.update, weights=args.weights,
            batch_invariant=getattr(args, "batch_invariant", False),  # the commands that run an engine have the flag
            tokenizer=getattr(args, "tokenizer", None), chat_template=getattr(args, "chat_template", None),
            shard=TensorShard(0, size) if size > 1 else None,
            int8_activations=getattr(args, "int8_activations", False),
        )  # fmt: skip
