#!/usr/bin/env bash
# The technique benchmarks at two commits in one run, alternating, on the same machine:
#   benchmarks/ab/run.sh BASE_WORKTREE OUT_DIR [BENCHMARK]
# BASE_WORKTREE is a checkout of the older commit (git worktree add /tmp/base <commit>); this checkout is
# the newer one. Both run on this checkout's .venv (the same torch and model), the older one through
# PYTHONPATH. Each command is run base then head, so a slow spell of the machine hits both.
set -euo pipefail
base=$(realpath "$1"); out=$2; here=$(cd "$(dirname "$0")/../.." && pwd)
mkdir -p "$out"
py="$here/.venv/bin/python"
benches=(
  "compression --threads 2 --num-requests 16"
  "offload --threads 2 --tiers host --policies full,infinigen,int4 --contexts 4096 --batches 8,1"
  "prompt-cache --threads 2 --questions 5 --lengths 1024,4096"
  "prefill --threads 2 --prefill-parallel 2 --lengths 1000,4000 --methods single,KVR-E --repeats 2"
  "latency --threads 2 --dtype bfloat16 --no-peer"
  "speed --threads 2 --peers="
  "throughput --threads 2 --no-peer"
  "prefix --threads 2"
)
# AB_BENCHES (one benchmark command a line) replaces the list: benchmarks/ab/engine-parts/run_named.sh sets it.
[ -n "${AB_BENCHES:-}" ] && mapfile -t benches <<< "$AB_BENCHES"
only=${3:-}  # a benchmark name: run that one only
for bench in "${benches[@]}"; do
  [ -n "$only" ] && [ "${bench%% *}" != "$only" ] && continue
  name=${bench%% *}
  for side in base head; do
    root=$here; [ "$side" = base ] && root=$base
    # `python -m kvserve` runs the command; a commit before kvserve/__main__.py had it in kvserve/cli.py.
    module=kvserve; [ -f "$root/kvserve/__main__.py" ] || module=kvserve.cli
    echo "== $side: kvserve bench $bench" >&2
    (cd "$out" && PYTHONPATH="$root" KVSERVE_DATA="${KVSERVE_DATA:-$here/../shared/data}" \
      "$py" -m $module bench $bench --output "$out/$name-$side") 2>&1 | tail -3 >&2
  done
done
