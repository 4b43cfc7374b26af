#!/usr/bin/env bash
# Reproduces every figure in benchmarks/eval/README.md, one command after another (they share the CPU).
# Run from the repository root with the venv active:
#   bash benchmarks/eval/run_all.sh [crosscheck|headline|all]   (THREADS=N sets torch's CPU threads)
set -euo pipefail
OUT=benchmarks/eval
CROSS=$OUT/crosscheck
STAGE=${1:-all}
T=(--threads "${THREADS:-2}")

crosscheck() {
  # kvserve and Hugging Face transformers on the same weights and the same tokens, both float32
  # (transformers dequantises the GGUF itself); then kvserve in bfloat16 on the same text.
  for backend in kvserve hf; do
    kvserve eval ppl --data wikitext-2 --limit-tokens 32768 --dtype float32 --backend $backend "${T[@]}" \
      --output $CROSS/ppl-wikitext2-32k-$backend-float32
    for task in copa piqa; do
      kvserve eval mc --task $task --dtype float32 --backend $backend "${T[@]}" --output $CROSS/mc-$task-$backend-float32
    done
  done
  kvserve eval ppl --data wikitext-2 --limit-tokens 32768 --dtype bfloat16 "${T[@]}" \
    --output $CROSS/ppl-wikitext2-32k-kvserve-bfloat16
}

headline() {
  # The default model at full cache, bfloat16.
  kvserve eval ppl --data wikitext-2 --context 2048 --stride 512 --dtype bfloat16 "${T[@]}" \
    --output $OUT/ppl-wikitext2-bfloat16
  for task in piqa copa winogrande arc_easy lambada; do
    kvserve eval mc --task $task --dtype bfloat16 "${T[@]}" --output $OUT/mc-$task-bfloat16
  done
  for task in quality natural_question topic_retrieval meeting gov_report; do
    kvserve eval longqa --task $task --dtype bfloat16 --kv-cache-memory 2GiB "${T[@]}" --output $OUT/longqa-$task-bfloat16
  done
  kvserve eval needle --lengths 1k,2k,4k,8k --depths 0..100% --dtype bfloat16 --kv-cache-memory 2GiB "${T[@]}" \
    --output $OUT/needle-bfloat16
}

case $STAGE in
  crosscheck) crosscheck ;;
  headline) headline ;;
  all) crosscheck; headline ;;
  *) echo "usage: $0 [crosscheck|headline|all]" >&2; exit 2 ;;
esac
