#!/usr/bin/env bash
# Source at the start of every device run (repo root as cwd): installs the carried wheels and this package
# into /tmp/site, so that `hf_openjev.ops` / `hf_openjev.patches` resolve as they do in an installed env.
set -e
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade --target /tmp/site . >/dev/null  # --upgrade: a warm machine keeps the last call's copy otherwise
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 REPO TRITON_CACHE_DIR=/tmp/triton_cache
# (the Triton cache under /tmp survives between calls on a warm machine; a fresh machine recompiles, ~1-2 min)
python3 -c "import torch, transformers, triton, fla, hf_openjev; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__, 'fla', fla.__version__, torch.cuda.get_device_name(0))"
set +e
