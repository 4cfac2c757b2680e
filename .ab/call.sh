#!/usr/bin/env bash
# whichever GPU comes: an H200 runs the family bench (issue 39's acceptance), an H100 the probe-capture A/B
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
echo "GPU: $gpu"
case "$gpu" in
  *H200*) bash recipes/gpu_campaign.sh family 2>&1 | tail -n 40 ;;
  *) bash .ab/run.sh 2>&1 | tail -n 40 ;;
esac
