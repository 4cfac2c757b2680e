#!/usr/bin/env bash
# ad hoc A/B (not committed): PackGraphs capture through torch.cuda.graph (old) vs recording() (new), 2B warm cache
set -u
start=$SECONDS
REPO=$PWD
use() { cp "$REPO/.ab/cuda_graphs_$1.py" "$REPO/patches/cuda_graphs.py"; (cd "$REPO" && source recipes/device_setup.sh >/dev/null); }
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 FLA_FLASH_QLA=0 TRITON_CACHE_DIR=/tmp/tc_ab
run() {  # label shape limit
  left=$((${AB_LIMIT:-590} - (SECONDS - start))); lim=$3; [ "$left" -lt "$lim" ] && lim=$left
  [ "$lim" -gt 20 ] || { echo "$1: no time"; return; }
  (cd /tmp && timeout "$lim" python3 "$REPO/recipes/warmup_breakdown.py" --shape "$2" --out "$OUT/$1" 2>&1 \
    | grep -E "whole pass|capture|other|compiles" | tr '\n' ' ')
  echo " <- $1 rc=${PIPESTATUS[0]} at $((SECONDS - start)) s"
}
use new; run 2b-new-0 2b 120; run 2b-new-1 2b 90
use old; run 2b-old-1 2b 90
use new; run 2b-new-2 2b 90
use old; run 2b-old-2 2b 90
use new
left=$(( ${AB_LIMIT:-590} - (SECONDS - start) - 5 )); [ "$left" -gt 30 ] && (cd /tmp && timeout "$left" python3 -m pytest -q -m gpu -p no:cacheprovider "$REPO/tests/test_cuda_graphs.py" 2>&1 | tail -n 5)
echo "pytest at $((SECONDS - start)) s"
run 27b-new-cold-carried 27b 400
