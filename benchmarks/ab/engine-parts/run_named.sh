#!/usr/bin/env bash
# The five benchmarks the engine-parts rework names, at two commits, base then head for each (sizes cut to fit
# a quiet spell of a 2-core machine), through benchmarks/ab/run.sh:
#   benchmarks/ab/engine-parts/run_named.sh BASE_WORKTREE OUT_DIR
set -euo pipefail
AB_BENCHES="speed --threads 2 --peers=
compression --threads 2 --num-requests 8
offload --threads 2 --tiers host --policies full,infinigen --contexts 4096 --batches 1
prompt-cache --threads 2 --questions 3 --lengths 1024
prefill --threads 2 --prefill-parallel 2 --lengths 1000 --methods single,KVR-E --repeats 2" \
  exec "$(dirname "$0")/../run.sh" "$@"
