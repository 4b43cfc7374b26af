"""llama.cpp speed worker: greedy generation on a GGUF file through llama-cpp-python's low-level API.

The kvserve speed benchmark (``speed.py``) starts this script as a subprocess under an interpreter that has
``llama_cpp`` installed, so it may import only the standard library, numpy and ``llama_cpp`` (not kvserve or torch).
It drives ``llama_decode`` directly the way llama.cpp's ``examples/batched/batched.cpp`` does (one ``llama_batch``
holding several sequences, each token with its own ``seq_id`` and ``pos``, logits only for each sequence's last token),
so the figures measure llama.cpp itself, not the high-level ``Llama`` wrapper's per-token Python work.

Usage::

    python llamacpp_worker.py MODEL.gguf --threads 2 --n-ctx 8192 --max-seqs 32
    python llamacpp_worker.py MODEL.gguf --type-k q8_0 --type-v q8_0 --flash-attn on  # a quantized KV cache

Protocol: one JSON line on stdout once loaded, ``{"ready": true, "load_s": ..., "llama_cpp": ..., "system_info": ...,
"type_k": ..., "type_v": ..., "flash_attn": ..., "use_extra_bufts": false, ...}``,
then one JSON answer line per JSON command line read from stdin:

- ``{"op": "generate", "ids": [...], "new_tokens": N}`` -> ``{"seconds": s, "first_token_s": f, "tokens": [N ids]}``
  (``f``: the prefill, which samples the first token)
- ``{"op": "batch", "prompts": [[...], ...], "new_tokens": N}`` -> ``{"seconds": s, "first_token_s": f, "tokens":
  [[N ids], ...]}`` (``f``: all prompts' prefill, which samples every sequence's first token)
- ``{"op": "quit"}`` -> frees everything and exits 0.

Generation is greedy (argmax) and ignores EOS, so exactly N tokens come back per sequence. A failure answers
``{"error": "..."}`` and the worker keeps serving. llama.cpp's own messages go to stderr.

Settings chosen on purpose:

- ``use_extra_bufts = False``: llama.cpp's AMX extra buffer type (weight repacking for AMX tiles) crashes on the
  benchmark machine with SIGSEGV at ``ldtilecfg``, so the plain CPU buffers are used.
- Flash attention off (``LLAMA_FLASH_ATTN_TYPE_DISABLED``) unless ``--flash-attn on``: on this CPU llama.cpp decodes
  faster without it, and the default ("auto") turns it on for the CPU backend. A quantized V cache needs it on.
- The KV cache in f16 (llama.cpp's default), or ``--type-k`` / ``--type-v`` (``q8_0``, ``q4_0``, ...; ggml's
  ``type_k`` and ``type_v`` context parameters).
- ``kv_unified = True`` (unless ``--split-kv``): the KV cache is one pool of ``n_ctx`` cells shared by all sequences.
  With a split cache each sequence owns only ``n_ctx / n_seq_max`` cells, and the benchmark needs both 32 short
  sequences at once and a single 2048+ token prompt from the same context. With a shared pool llama.cpp's rounding
  depends on where a sequence's cells lie, so a sequence in a mixed batch may drift from its batch-1 greedy tokens
  after some steps (the other sequences' contents never affect it); with ``--split-kv`` they match exactly.
- ``n_batch = n_ubatch`` (2048 by default): a 2048-token prompt is one ``llama_decode`` call and one compute graph.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import IO, Any

import llama_cpp
import numpy as np

# ggml log levels (enum ggml_log_level in ggml.h; llama_cpp/_logger.py still has the older numbering).
_LOG_WARN = 3
_LOG_ERROR = 4
_LOG_CONT = 5  # continues the previous message, at its level

# The log callback handed to llama.cpp; a module global so that it outlives every call into C.
_log_callback: Any = None


class Worker:
    """One llama.cpp model and context, plus a reusable batch big enough for a prompt chunk or a decode step."""

    def __init__(
        self, model_path: str, threads: int, n_ctx: int, max_seqs: int, n_batch: int, kv_unified: bool,
        type_k: str = "f16", type_v: str = "f16", flash_attn: str = "off",
    ) -> None:  # fmt: skip
        if type_v not in UNQUANTIZED_KV_TYPES and flash_attn != "on":
            raise ValueError(f"a quantized V cache (--type-v {type_v}) needs flash attention: pass --flash-attn on")
        llama_cpp.llama_backend_init()

        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        model_params.use_extra_bufts = False  # the AMX extra buffer type segfaults here (ldtilecfg)
        self.use_extra_bufts = bool(model_params.use_extra_bufts)  # as the model was loaded, for the ready line
        self.model = llama_cpp.llama_model_load_from_file(os.fsencode(model_path), model_params)
        if not self.model:
            raise RuntimeError(f"could not load the model {model_path}")

        ctx_params = llama_cpp.llama_context_default_params()
        ctx_params.n_ctx = n_ctx
        ctx_params.n_batch = n_batch
        ctx_params.n_ubatch = n_batch  # one physical batch per logical batch: a whole prompt is one graph
        ctx_params.n_seq_max = max_seqs
        ctx_params.n_threads = threads
        ctx_params.n_threads_batch = threads
        ctx_params.flash_attn_type = _flash_attn_type(flash_attn)  # off by default: faster on this CPU
        ctx_params.type_k = _ggml_type(type_k)
        ctx_params.type_v = _ggml_type(type_v)
        ctx_params.kv_unified = kv_unified
        ctx_params.offload_kqv = False
        ctx_params.no_perf = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, ctx_params)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError("could not create the llama.cpp context")

        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_ctx_seq = llama_cpp.llama_n_ctx_seq(self.ctx)
        self.n_batch = llama_cpp.llama_n_batch(self.ctx)
        self.max_seqs = max_seqs
        self.kv_unified = kv_unified
        self.type_k, self.type_v, self.flash_attn = type_k, type_v, flash_attn

        # One sequence id per token is all this worker uses, so the batch is allocated with n_seq_max = 1.
        self.capacity = max(self.n_batch, max_seqs)
        self.batch = llama_cpp.llama_batch_init(self.capacity, 0, 1)
        self.tokens = np.ctypeslib.as_array(self.batch.token, shape=(self.capacity,))
        self.pos = np.ctypeslib.as_array(self.batch.pos, shape=(self.capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.batch.n_seq_id, shape=(self.capacity,))
        self.logits = np.ctypeslib.as_array(self.batch.logits, shape=(self.capacity,))
        self.n_seq_id[:] = 1

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)
        llama_cpp.llama_free(self.ctx)
        llama_cpp.llama_model_free(self.model)
        llama_cpp.llama_backend_free()

    def generate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> tuple[float, float, list[list[int]]]:
        """Prefill every prompt (sequence i = prompt i), then decode all sequences together, greedy, EOS ignored.
        Returns the seconds in all, the seconds to the first tokens (the prefill) and the tokens."""
        self._validate(prompts, new_tokens)
        # Metadata-only clear: the cells become free; zeroing the buffers would only cost time.
        llama_cpp.llama_memory_clear(self.memory, False)

        start = time.perf_counter()
        outputs: list[list[int]] = [[] for _ in prompts]
        self._prefill(prompts, outputs)
        first_token_s = time.perf_counter() - start
        n_seqs = len(prompts)
        positions = np.array([len(p) for p in prompts], dtype=np.int32)
        self._set_seq_ids(np.arange(n_seqs, dtype=np.int32))
        self.logits[:n_seqs] = 1
        for _ in range(new_tokens - 1):
            # One llama_decode per step: token t of every sequence, each at its own position.
            self.tokens[:n_seqs] = [out[-1] for out in outputs]
            self.pos[:n_seqs] = positions
            self._decode(n_seqs)
            for i, out in enumerate(outputs):
                out.append(self._argmax(i))
            positions += 1
        seconds = time.perf_counter() - start
        return seconds, first_token_s, outputs

    def _prefill(self, prompts: Sequence[Sequence[int]], outputs: list[list[int]]) -> None:
        """All prompts in as few llama_decode calls as n_batch allows; logits only for each prompt's last token."""
        tokens = np.concatenate([np.asarray(p, dtype=np.int32) for p in prompts])
        pos = np.concatenate([np.arange(len(p), dtype=np.int32) for p in prompts])
        seq = np.concatenate([np.full(len(p), i, dtype=np.int32) for i, p in enumerate(prompts)])
        last = np.cumsum([len(p) for p in prompts]) - 1
        want = np.zeros(len(tokens), dtype=np.int8)
        want[last] = 1
        for begin in range(0, len(tokens), self.n_batch):
            end = min(begin + self.n_batch, len(tokens))
            n = end - begin
            self.tokens[:n] = tokens[begin:end]
            self.pos[:n] = pos[begin:end]
            self.logits[:n] = want[begin:end]
            self._set_seq_ids(seq[begin:end])
            self._decode(n)
            # The next llama_decode overwrites the logits, so read this chunk's outputs now.
            for j in np.flatnonzero(want[begin:end]):
                outputs[seq[begin + j]].append(self._argmax(int(j)))

    def _set_seq_ids(self, seq_ids: np.ndarray) -> None:
        # seq_id is an array of per-token pointers (allocated by llama_batch_init), so it is filled one by one.
        pointers = self.batch.seq_id
        for i, s in enumerate(seq_ids.tolist()):
            pointers[i][0] = s

    def _decode(self, n_tokens: int) -> None:
        self.batch.n_tokens = n_tokens
        status = llama_cpp.llama_decode(self.ctx, self.batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status} for a batch of {n_tokens} tokens")

    def _argmax(self, batch_index: int) -> int:
        pointer = llama_cpp.llama_get_logits_ith(self.ctx, batch_index)
        if not pointer:
            raise RuntimeError(f"no logits for batch index {batch_index}")
        return int(np.argmax(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))))

    def _validate(self, prompts: Sequence[Sequence[int]], new_tokens: int) -> None:
        if not prompts:
            raise ValueError("no prompts")
        if len(prompts) > self.max_seqs:
            raise ValueError(f"{len(prompts)} prompts but the context was made for --max-seqs {self.max_seqs}")
        if new_tokens < 1:
            raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")
        for prompt in prompts:
            if not prompt:
                raise ValueError("empty prompt")
            if min(prompt) < 0 or max(prompt) >= self.n_vocab:
                raise ValueError(f"token id out of range [0, {self.n_vocab})")
            # The last generated token is never fed back, so a sequence holds len + new_tokens - 1 cells.
            if len(prompt) + new_tokens - 1 > self.n_ctx_seq:
                raise ValueError(f"{len(prompt)} + {new_tokens} tokens exceed the per-sequence n_ctx {self.n_ctx_seq}")
        cells = sum(len(p) + new_tokens - 1 for p in prompts)
        if self.kv_unified and cells > self.n_ctx:
            raise ValueError(f"{cells} KV cells needed but n_ctx is {self.n_ctx}")


# ggml_type ids (enum ggml_type in ggml.h) of the KV cache types this worker accepts.
KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
UNQUANTIZED_KV_TYPES = ("f32", "f16", "bf16")


def _ggml_type(name: str) -> int:
    return int(getattr(llama_cpp, f"GGML_TYPE_{name.upper()}", KV_TYPES[name]))


def _flash_attn_type(mode: str) -> int:
    names = {"on": "ENABLED", "off": "DISABLED", "auto": "AUTO"}
    return int(getattr(llama_cpp, f"LLAMA_FLASH_ATTN_TYPE_{names[mode]}"))


def _handle(worker: Worker, command: dict[str, Any]) -> dict[str, Any]:
    op = command.get("op")
    if op == "generate":
        seconds, first_token_s, tokens = worker.generate([command["ids"]], int(command["new_tokens"]))
        return {"seconds": seconds, "first_token_s": first_token_s, "tokens": tokens[0]}
    if op == "batch":
        seconds, first_token_s, tokens = worker.generate(command["prompts"], int(command["new_tokens"]))
        return {"seconds": seconds, "first_token_s": first_token_s, "tokens": tokens}
    raise ValueError(f"unknown op {op!r}")


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def _protocol_stream() -> IO[str]:
    """A private handle on the real stdout; fd 1 itself is pointed at stderr.

    Native code (llama.cpp, ggml, OpenMP) may print to fd 1 directly, which would corrupt the JSON protocol.
    """
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def _install_log_filter(verbose: bool) -> None:
    """Send llama.cpp's log to stderr: warnings and errors only, or everything with --verbose."""
    global _log_callback
    last_level = _LOG_WARN

    def log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
        nonlocal last_level
        if level != _LOG_CONT:
            last_level = level
        if verbose or last_level in (_LOG_WARN, _LOG_ERROR):
            sys.stderr.write(text.decode("utf-8", errors="replace"))
            sys.stderr.flush()

    _log_callback = llama_cpp.llama_log_callback(log)
    llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", help="GGUF file")
    parser.add_argument("--threads", type=int, default=2, help="n_threads and n_threads_batch")
    parser.add_argument("--n-ctx", type=int, default=8192, help="KV cells (shared by all sequences unless --split-kv)")
    parser.add_argument("--max-seqs", type=int, default=32, help="most sequences in one 'batch' command (n_seq_max)")
    parser.add_argument("--n-batch", type=int, default=2048, help="n_batch = n_ubatch (capped at --n-ctx)")
    parser.add_argument(
        "--split-kv",
        action="store_true",
        help="kv_unified=False: each sequence gets its own n_ctx/max_seqs cells (long single prompts may not fit)",
    )
    parser.add_argument("--type-k", choices=KV_TYPES, default="f16", help="the K cache's type (type_k)")
    parser.add_argument("--type-v", choices=KV_TYPES, default="f16", help="the V cache's type (type_v)")
    parser.add_argument(
        "--flash-attn", choices=("on", "off", "auto"), default="off",
        help="flash attention (flash_attn_type); a quantized V cache needs it on",
    )  # fmt: skip
    parser.add_argument("--verbose", action="store_true", help="all of llama.cpp's log on stderr")
    args = parser.parse_args()

    out = _protocol_stream()
    _install_log_filter(args.verbose)
    n_batch = min(args.n_batch, args.n_ctx)
    if args.max_seqs > n_batch:
        _send(out, {"ready": False, "error": f"--max-seqs {args.max_seqs} exceeds n_batch {n_batch}"})
        return 1

    start = time.perf_counter()
    try:
        worker = Worker(
            args.model, args.threads, args.n_ctx, args.max_seqs, n_batch, not args.split_kv, args.type_k,
            args.type_v, args.flash_attn,
        )  # fmt: skip
    except Exception as exc:  # report it on the protocol so the caller sees why
        _send(out, {"ready": False, "error": str(exc)})
        return 1
    load_s = time.perf_counter() - start
    _send(
        out,
        {
            "ready": True,
            "load_s": load_s,
            "llama_cpp": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
            "n_ctx": worker.n_ctx,
            "n_batch": worker.n_batch,
            "n_vocab": worker.n_vocab,
            "kv_unified": worker.kv_unified,
            "type_k": worker.type_k,
            "type_v": worker.type_v,
            "flash_attn": worker.flash_attn,
            "use_extra_bufts": worker.use_extra_bufts,
            "threads": args.threads,
        },
    )

    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            try:
                command = json.loads(line)
                if command.get("op") == "quit":
                    break
                answer = _handle(worker, command)
            except Exception as exc:  # any failure is one error answer; the worker keeps serving
                answer = {"error": f"{type(exc).__name__}: {exc}"}
            _send(out, answer)
    finally:
        worker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
