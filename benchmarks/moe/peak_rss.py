"""Peak resident memory of kvserve and llama.cpp on one GGUF file, each in a fresh process doing the same work:
load, then N concurrent sequences of a short prompt generating greedy tokens. The peak is the child's
``ru_maxrss`` from ``wait4`` (Linux: the high-water mark of its resident set, every page it touched).

    python benchmarks/moe/peak_rss.py MODEL.gguf --llamacpp-python PATH [--seqs 8 --new-tokens 32]

kvserve gets a KV memory about llama.cpp's ``n_ctx`` (``--n-ctx`` tokens of this model's bfloat16 K and V) and no
swap space, so both hold the same context; llama.cpp runs through kvserve's speed worker (extra buffer types off).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

WORKER = Path(__file__).resolve().parents[2] / "kvserve" / "bench" / "llamacpp_worker.py"

KVSERVE = """
import sys
from kvserve import LLM, SamplingParams
from kvserve.models.loader import read_model_config
model, seqs, new_tokens, n_ctx, threads = sys.argv[1], *map(int, sys.argv[2:])
import torch
torch.set_num_threads(threads)
cfg = read_model_config(model)
kv_bytes = n_ctx * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
llm = LLM(model, kv_cache_memory=kv_bytes, swap_space=0, max_num_seqs=seqs, enable_prefix_caching=False)
prompts = [[100 + i, 200 + i, 300 + i, 400 + i] * 8 for i in range(seqs)]
outs = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
assert all(len(o.outputs[0].token_ids) == new_tokens for o in outs)
"""


def peak_of(command: list[str], stdin: str | None = None) -> int:
    """Run ``command`` to completion; its peak resident set in bytes."""
    process = subprocess.Popen(command, stdin=subprocess.PIPE if stdin else None, stdout=subprocess.DEVNULL)
    if stdin:
        process.stdin.write(stdin.encode())
        process.stdin.close()
    _, status, usage = os.wait4(process.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{command[:3]} failed with status {os.waitstatus_to_exitcode(status)}")
    return usage.ru_maxrss * 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--llamacpp-python", required=True, help="interpreter with llama_cpp")
    parser.add_argument("--seqs", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--n-ctx", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    numbers = [str(args.seqs), str(args.new_tokens), str(args.n_ctx), str(args.threads)]
    kvserve = peak_of([sys.executable, "-c", KVSERVE, str(args.model), *numbers])
    prompts = [[100 + i, 200 + i, 300 + i, 400 + i] * 8 for i in range(args.seqs)]
    commands = json.dumps({"op": "batch", "prompts": prompts, "new_tokens": args.new_tokens}) + "\n"
    commands += json.dumps({"op": "quit"}) + "\n"
    worker = [args.llamacpp_python, str(WORKER), str(args.model), "--threads", str(args.threads)]
    worker += ["--n-ctx", str(args.n_ctx), "--max-seqs", str(args.seqs)]
    llamacpp = peak_of(worker, commands)
    result = {
        "model": args.model.name,
        "file_bytes": args.model.stat().st_size,
        "kvserve_peak_rss_bytes": kvserve,
        "llamacpp_peak_rss_bytes": llamacpp,
        "ratio": kvserve / llamacpp,
        "seqs": args.seqs,
        "new_tokens": args.new_tokens,
        "n_ctx": args.n_ctx,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
