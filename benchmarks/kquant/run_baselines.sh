#!/usr/bin/env bash
# kvserve against llama.cpp on one Q4_K_M file each (the shipped Gemma 3 270M, the Llama-3.2-1B and -3B shaped
# files of make_llama_gguf.py), 2 threads, one `bench speed` run per model. Run from the repository root:
#     PYTHON=.venv/bin/python LLAMACPP_PYTHON=/path/python-with-llama_cpp MODELS=/work/kq-models \
#         bash benchmarks/kquant/run_baselines.sh [PREFIX]
# PREFIX names the reports (default "baseline"). Both engines hold a context of 4,096 tokens: llama.cpp n_ctx 4096
# (one pool shared by all sequences), kvserve the KV memory of 4,096 tokens and no swap space; 32 sequences of 32
# prompt tokens generating 64 each fit in it. N_CTX=0 gives llama.cpp its stream per sequence instead (its faster
# setting for many sequences; each stream holds the longest prompt) and kvserve its default KV memory (1 GiB + swap).
set -euo pipefail
PYTHON=${PYTHON:-python}
LLAMACPP_PYTHON=${LLAMACPP_PYTHON:?the interpreter with llama_cpp}
MODELS=${MODELS:-/work/kq-models}
PREFIX=${1:-baseline}
N_CTX=${N_CTX:-4096}
OUT=benchmarks/kquant
common=(--peers llamacpp --llamacpp-python "$LLAMACPP_PYTHON" --threads 2 --n-ctx "$N_CTX" --prefill-lengths 512
        --decode-tokens 64 --long-decode-contexts "" --batch-sizes 32 --batch-prompt-tokens 32
        --batch-new-tokens 64)
"$PYTHON" -m kvserve.entrypoints.cli bench speed --model gemma3-270m "${common[@]}" --repeats 3 \
    --output "$OUT/$PREFIX-gemma3-270m-q4km"
"$PYTHON" -m kvserve.entrypoints.cli bench speed --model "$MODELS/Llama-3.2-1B-shaped-Q4_K_M.gguf" "${common[@]}" --repeats 3 \
    --output "$OUT/$PREFIX-llama32-1b-q4km"
"$PYTHON" -m kvserve.entrypoints.cli bench speed --model "$MODELS/Llama-3.2-3B-shaped-Q4_K_M.gguf" "${common[@]}" --repeats 2 \
    --output "$OUT/$PREFIX-llama32-3b-q4km"
