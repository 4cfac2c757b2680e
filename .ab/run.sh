#!/usr/bin/env bash
# the probe-capture A/B: the capture GPU tests, then C's warm-up with each capture, alternated, one machine
set -uo pipefail
source recipes/device_setup.sh
export FLA_FLASH_QLA=0
S=$SECONDS
o=$OUT/ab
mkdir -p "$o"
cd /tmp || exit 1
timeout 200 python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/test_cuda_graphs.py" -m gpu \
  -k "probe or graph_replay_matches_eager or warm_up_captures" -v -s --durations=0 -p no:cacheprovider >"$o/pytest.log" 2>&1
echo "pytest rc=$? at $((SECONDS - S)) s"
grep -E "PASSED|FAILED|ERROR|passed|failed|Error" "$o/pytest.log" | tail -n 14
n=0
for run in "2b eager" "2b probe" "2b eager" "2b probe" "27b probe" "27b eager" "27b probe"; do
  set -- $run
  n=$((n + 1))
  left=$((585 - (SECONDS - S)))
  [ "$left" -gt 100 ] || { echo "$run: no time left"; continue; }
  timeout "$left" python3 "$REPO/recipes/warmup_breakdown.py" --shape "$1" --capture "$2" --out "$o/$n-$1-$2" 2>&1 \
    | grep -E "^\| (whole|captures|- capture|other|Triton|autotuning)" | tr '\n' ' '
  echo "<- $n $run rc=${PIPESTATUS[0]} at $((SECONDS - S)) s"
done
tar czf "$OUT/ab.tgz" -C "$o" .
