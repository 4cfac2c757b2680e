#!/usr/bin/env bash
# One H200 campaign, in stages that each fit the device's 10-minute command limit. Run one stage per call:
#   bash recipes/gpu_campaign.sh ops        # ops vs references, capture/replay, micro-benchmarks (issue 4)
#   bash recipes/gpu_campaign.sh parity     # fast path vs reference, fp32 and bf16, mid-size shape (issue 5)
#   bash recipes/gpu_campaign.sh bench      # the 27B benchmark, arms C, A, B (issue 8)
#   bash recipes/gpu_campaign.sh serve      # closed-loop clients at 1/8/16 in flight, 27B (issues 7, 8)
#   bash recipes/gpu_campaign.sh threshold  # prefix-sharing break-even: C at several min_shared_tokens (issue 5)
#   bash recipes/gpu_campaign.sh graphs     # CUDA-graph replay: the gpu test, then arm C with --cuda-graphs (issue 8)
# Each writes under $OUT/<stage>/ (markdown + JSON); copy them to recipes/results/<device>-<date>/ and commit.
# Call with carry [".whl"] (recipes/device_wheels.sh fetches the wheels). fla autotunes each new shape
# (~1-2 min on a fresh machine), so each stage starts with that cost.
set -uo pipefail
stage=${1:?stage: ops | parity | bench | serve | threshold | graphs}
source recipes/device_setup.sh
export FLA_FLASH_QLA=0
out=${OUT:-/tmp/out}/$stage
mkdir -p "$out"
cd /tmp
case "$stage" in
  ops)
    timeout 280 python3 "$REPO/recipes/gpu_ops_check.py" --out "$out" 2>&1 | tail -40
    timeout 250 python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO"/tests/test_op_*.py -m gpu -q \
      -p no:cacheprovider 2>&1 | tee "$out/pytest_gpu.log" | tail -15 ;;
  parity)
    timeout 280 python3 "$REPO/recipes/bench_jevbench.py" --shape mid --dtype float32 --arms C,A --passes 1 \
      --limit 120 --concurrency "" --long-candidate 0 --out "$out" 2>&1 | grep -v Loading | tail -8
    timeout 280 python3 "$REPO/recipes/bench_jevbench.py" --shape mid --dtype bfloat16 --arms C,A --passes 1 \
      --concurrency "" --long-candidate 0 --out "$out" 2>&1 | grep -v Loading | tail -8 ;;
  bench)
    timeout 570 python3 "$REPO/recipes/bench_jevbench.py" --shape 27b --arms C,A,B --passes 2 --b-passes 1 \
      --concurrency "" --long-candidate 16384 --out "$out" 2>&1 | grep -v Loading | tail -12 ;;
  serve)
    timeout 570 python3 "$REPO/recipes/bench_jevbench.py" --shape 27b --arms C --passes 1 \
      --concurrency 1,8,16 --long-candidate 0 --out "$out" 2>&1 | grep -v Loading | tail -12 ;;
  threshold)
    timeout 570 python3 "$REPO/recipes/bench_jevbench.py" --shape 27b --arms C --passes 1 --concurrency "" \
      --long-candidate 0 --sweep-min-shared 64,128,256,512 --out "$out" 2>&1 | grep -v Loading | tail -12 ;;
  graphs)
    timeout 150 python3 -m pytest -c "$REPO/pyproject.toml" --rootdir "$REPO" "$REPO/tests/test_cuda_graphs.py" -m gpu -q \
      -p no:cacheprovider 2>&1 | tee "$out/pytest_graphs.log" | tail -15
    timeout 420 python3 "$REPO/recipes/bench_jevbench.py" --shape 27b --arms C --passes 2 --cuda-graphs \
      --concurrency "" --long-candidate 0 --out "$out" 2>&1 | grep -v Loading | tail -12 ;;
  *) echo "unknown stage $stage"; exit 2 ;;
esac
