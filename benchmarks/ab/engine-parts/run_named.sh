#!/usr/bin/env bash
# The five benchmarks the engine-parts rework names, at two commits, base then head for each (sizes cut to fit
# a quiet spell of a 2-core machine):
#   benchmarks/ab/engine-parts/run_named.sh BASE_WORKTREE OUT_DIR
# Both sides run on this checkout's .venv, the older one through PYTHONPATH (as benchmarks/ab/run.sh does).
set -euo pipefail
base=$(realpath "$1"); out=$2; here=$(cd "$(dirname "$0")/../../.." && pwd)
mkdir -p "$out"
py="$here/.venv/bin/python"
benches=(
  "speed --threads 2 --peers="
  "compression --threads 2 --num-requests 8"
  "offload --threads 2 --tiers host --policies full,infinigen --contexts 4096 --batches 1"
  "prompt-cache --threads 2 --questions 3 --lengths 1024"
  "prefill --threads 2 --prefill-parallel 2 --lengths 1000 --methods single,KVR-E --repeats 2"
)
for bench in "${benches[@]}"; do
  name=${bench%% *}
  for side in base head; do
    root=$here; [ "$side" = base ] && root=$base
    module=kvserve; [ -f "$root/kvserve/__main__.py" ] || module=kvserve.cli
    echo "== $side: kvserve bench $bench" >&2
    (cd "$out" && PYTHONPATH="$root" KVSERVE_DATA="${KVSERVE_DATA:-$here/../shared/data}" \
      "$py" -m $module bench $bench --output "$out/$name-$side") 2>&1 | tail -3 >&2
  done
done
