"""kvserve speed worker: ``speed.KVServeSpeed`` in a process of its own, so that the resident set the benchmark
reads (``/proc/PID/status``, ``VmHWM``) is kvserve's alone, as the llama.cpp worker's is llama.cpp's: no roofline
buffers, no other engine, no parent bookkeeping.

    python -m kvserve.bench.kvserve_worker '{"model": ..., "dtype": ..., ...}' --threads 2

The JSON is ``KVServeSpeed``'s keyword arguments. The protocol is ``llamacpp_worker.py``'s: one JSON line on stdout
once loaded (``{"ready": true, "load_s": ..., "name": ..., "decode_bytes_per_token": ..., "kv_summary": ...}``),
then one answer line per command line read from stdin:

- ``{"op": "generate", "ids": [...], "new_tokens": N}`` -> ``{"seconds": s}``
- ``{"op": "decode", "ids": [...], "new_tokens": N}`` -> ``{"seconds": s}`` (first token to last)
- ``{"op": "batch", "prompts": [[...], ...], "new_tokens": N}`` -> ``{"seconds": s, "first_token_s": f}``
- ``{"op": "quit"}``

A failure answers ``{"error": "..."}`` and the worker keeps serving.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import IO, Any


def _send(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("options", help="KVServeSpeed's keyword arguments as JSON")
    parser.add_argument("--threads", type=int, required=True)
    args = parser.parse_args()
    # A private handle on the real stdout; anything else printing to fd 1 goes to stderr.
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch

    from kvserve.bench.speed import KVServeSpeed

    torch.set_num_threads(args.threads)
    try:
        engine = KVServeSpeed(**json.loads(args.options))
    except Exception as exc:  # report it on the protocol so the caller sees why
        _send(out, {"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        return 1
    _send(out, {
        "ready": True, "load_s": engine.load_s, "name": engine.name,
        "decode_bytes_per_token": engine.decode_bytes_per_token, "kv_summary": engine.llm.engine.kv_summary,
    })  # fmt: skip
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            op = command.get("op")
            if op == "quit":
                break
            if op == "generate":
                answer = {"seconds": engine.generate(command["ids"], int(command["new_tokens"]))}
            elif op == "decode":
                answer = {"seconds": engine.decode(command["ids"], int(command["new_tokens"]))}
            elif op == "batch":
                seconds, first_token_s = engine.batch_phases(command["prompts"], int(command["new_tokens"]))
                answer = {"seconds": seconds, "first_token_s": first_token_s}
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as exc:  # any failure is one error answer; the worker keeps serving
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        _send(out, answer)
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
