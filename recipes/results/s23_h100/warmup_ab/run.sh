#!/usr/bin/env bash
# ad hoc A/B (not committed): PackGraphs capture with a first replay (old, c4868e5^) vs eager answer + record only (new)
set -u
start=$SECONDS
REPO=$PWD
use() { cp "$REPO/.ab/cuda_graphs_$1.py" "$REPO/patches/cuda_graphs.py"; (cd "$REPO" && source recipes/device_setup.sh >/dev/null); }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 TRITON_CACHE_DIR=/tmp/tc_ab
run() {  # label shape limit
  left=$((${AB_LIMIT:-590} - (SECONDS - start))); lim=$3; [ "$left" -lt "$lim" ] && lim=$left
  [ "$lim" -gt 20 ] || { echo "$1: no time"; return; }
  (cd /tmp && timeout "$lim" python3 "$REPO/recipes/warmup_breakdown.py" --shape "$2" --out "$OUT/$1" 2>&1 \
    | grep -E "whole pass|capture|other|compiles|replay|record|eager" | tr '\n' ' ')
  echo " <- $1 rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
}
use new
(cd /tmp && timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -k "graph_replay_matches_eager or warm_up_captures or capture" "$REPO/tests/test_cuda_graphs.py" 2>&1 | tail -n 8)
echo "pytest at $((SECONDS - start)) s"
(cd /tmp && timeout 90 python3 "$REPO/recipes/op_launch_cost.py" --shape 27b --out "$OUT/launch" 2>&1 | tail -n 22)
echo "launch cost at $((SECONDS - start)) s"
run 2b-new-0 2b 120; run 2b-new-1 2b 90
use old; run 2b-old-1 2b 90
use new; run 2b-new-2 2b 90
use old; run 2b-old-2 2b 90
use new
run 27b-new 27b 400
echo "end at $((SECONDS - start)) s"
