#!/usr/bin/env bash
# The figures in benchmarks/speed/README.md, in order: logit accuracy per weights mode, WikiText-2
# perplexity per mode, then the speed comparison against llama.cpp and transformers.
# Usage: bash benchmarks/speed/run_all.sh [LLAMACPP_PYTHON]   (an interpreter with llama_cpp installed)
# Run on an otherwise idle machine: every figure is a wall-clock time.
set -euo pipefail
cd "$(dirname "$0")/../.."
llamacpp_python=${1:-}
out=benchmarks/speed
threads=2
python benchmarks/speed/weights_accuracy.py --output "$out/weights-accuracy.md"
for mode in float32:dequant bfloat16:dequant bfloat16:int4; do
    dtype=${mode%:*} weights=${mode#*:}
    kvserve eval ppl --dtype "$dtype" --weights "$weights" --threads "$threads" --data wikitext-2 --context 2048 \
        --stride 512 --limit-tokens 32768 --output "$out/ppl-$dtype-$weights.json"
done
kvserve bench speed --threads "$threads" ${llamacpp_python:+--llamacpp-python "$llamacpp_python"} \
    --output "$out/speed-native"
kvserve bench speed --model gemma3-270m --threads "$threads" ${llamacpp_python:+--llamacpp-python "$llamacpp_python"} \
    --output "$out/speed-gemma3-270m"
