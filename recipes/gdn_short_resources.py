"""Registers, spill stack and shared memory of the short GDN kernels, compiled for the H200 (sm_90) on any machine.

    python3 recipes/gdn_short_resources.py --out /tmp/gdn_res [--variants wy-bv32-w8-p8-s1-tf32x3,...]

No GPU needed: Triton compiles each variant (``recipes/gdn_short_check.py``'s names) ahead of time with the ptxas
its wheel bundles, and ``cuobjdump -res-usage`` reads the cubin. Needs torch and triton (not the interpreter: leave
``TRITON_INTERPRET`` unset). A kernel at 255 registers with a STACK above zero spills to local memory; that is a
reason a variant is slow, not a timing (the GPU recipe times them). Writes ``gdn_short_resources.json`` under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

TARGET = ("cuda", 90, 32)
SHAPE = dict(DK=128, DV=128)  # the 27B GDN head dims
VARIANTS = "wy-bv32-w8-p8-s1-tf32x3,wy-bv32-w4-p4-s1-tf32x3,wy-bv32-w8-p8-s3-tf32x3,wy-bv32-w8-p8-s1-bf16x3," \
           "wy-bv32-w8-p8-s1-ieee,bv32-c16-w4-ieee"
PREP = dict(K="*bf16", V="*bf16", G="*fp32", BETA="*bf16", CU="*i32", W="*fp32", U="*fp32", N="i32", Hk="i32",
            Hv="i32", GROUP="i32")
STATE = dict(Q="*bf16", K="*bf16", G="*fp32", W="*fp32", U="*fp32", CU="*i32", H0="*fp32", OUT="*bf16", HT="*fp32",
             scale="fp32", Hk="i32", Hv="i32", GROUP="i32")
V1 = dict(Q="*bf16", K="*bf16", V="*bf16", G="*fp32", BETA="*bf16", CU="*i32", H0="*fp32", OUT="*bf16",
          HT="*fp32", scale="fp32", Hk="i32", Hv="i32", GROUP="i32")


def parse_resource_usage(text: str) -> dict:
    """``cuobjdump -res-usage`` output -> dict(registers, stack, shared) of its first function."""
    match = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+)", text)
    if match is None:
        raise ValueError("no 'REG:.. STACK:.. SHARED:..' line in cuobjdump's output; is the cubin empty?")
    return dict(zip(("registers", "stack", "shared"), map(int, match.groups())))


def kernels_of(variant: str) -> list[tuple[str, object, dict, dict, dict]]:
    """(name, jit function, signature, constexprs, options) for each kernel a variant launches (bf16 inputs)."""
    from gdn_short_check import parse_variant

    options = parse_variant(variant)
    prec = options["precision"]
    if options.get("design") != "wy":
        from hf_openjev.ops.gdn_short_triton import _gdn_short_kernel

        consts = dict(SHAPE, BV=options["block_v"], BT=options["chunk"], HAS_H0=True, STORE_FINAL=True, PREC=prec)
        return [("one-launch", _gdn_short_kernel, V1, consts, dict(num_warps=options["num_warps"]))]
    from hf_openjev.ops.gdn_wy_triton import _gdn_wy_prep_kernel, _gdn_wy_state_kernel

    prep = dict(SHAPE, BN=16, PREC=prec, NATIVE=True)
    state = dict(SHAPE, BV=options["block_v"], HAS_H0=True, STORE_FINAL=True, PREC=prec, NATIVE=True)
    return [("prep", _gdn_wy_prep_kernel, PREP, prep, dict(num_warps=options["prep_warps"])),
            ("state", _gdn_wy_state_kernel, STATE, state,
             dict(num_warps=options["num_warps"], num_stages=options["num_stages"]))]


def resources(variant: str, workdir: Path) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    rows = []
    for name, fn, signature, consts, options in kernels_of(variant):
        source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in consts}}, constexprs=consts)
        compiled = triton.compile(source, target=GPUTarget(*TARGET), options=options)
        cubin = workdir / f"{variant}-{name}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True, check=True)
        rows.append(dict(variant=variant, kernel=name, **options, **parse_resource_usage(usage.stdout),
                         triton_shared=compiled.metadata.shared))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for gdn_short_resources.json")
    parser.add_argument("--variants", default=VARIANTS, help="comma-separated names as in gdn_short_check.py")
    opts = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this recipe compiles for sm_90, the interpreter compiles nothing")
    os.environ["TRITON_INTERPRET"] = "0"  # gdn_short_check sets it to 1 on a machine without CUDA unless it is set
    opts.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [row for variant in opts.variants.split(",") for row in resources(variant, Path(tmp))]
    (opts.out / "gdn_short_resources.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
