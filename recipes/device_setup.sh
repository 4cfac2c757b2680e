#!/usr/bin/env bash
# Source at the start of every device run (repo root as cwd): installs the carried wheels and this package
# into /tmp/site, so that `hf_openjev.ops` / `hf_openjev.patches` resolve as they do in an installed env.
set -e
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site . >/dev/null
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 REPO TRITON_CACHE_DIR=/tmp/triton_cache
# a Triton cache brought back by an earlier call (gpu_campaign.sh leaves $OUT/triton_cache.tgz): no recompiling
if [ -f .tcache/triton_cache.tgz ] && [ ! -d /tmp/triton_cache ]; then tar xzf .tcache/triton_cache.tgz -C /tmp; fi
python3 -c "import torch, transformers, triton, fla, hf_openjev; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(0))"
set +e
