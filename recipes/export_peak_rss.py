"""Measure the peak host memory (RSS) of ``hf_openjev.export.merge.merge_lora`` on a synthetic base of several GB.

    python recipes/export_peak_rss.py [--workdir /tmp/...] [--layers 16] [--hidden 2048] [--base-shard-gb 2.5 5]

What it does:

1. writes a synthetic Qwen3.5-shaped base (a full ``qwen3_5`` checkpoint: text weights under
   ``model.language_model.``, plus ``lm_head`` and an MTP tensor that export drops) with random bf16 weights,
   in safetensors shards of at most ``--base-shard-gb``, and a matching published-style package (random fp32
   rank-8 LoRA on the published target modules, a head, a temperature);
2. runs in fresh child processes: (a) the import floor (``import hf_openjev.export.merge`` and the libraries the export
   loads, nothing else), (b) ``merge_lora(..., verify=False)``, (c) ``merge_lora(...)`` with the default
   verification (each merged tensor against PEFT ``merge_and_unload``; the CPU fp32 score probe is skipped for a
   backbone of this size, as the default ``probe="auto"`` does);
3. reads each child's peak RSS from ``os.wait4`` (``ru_maxrss``; the child's ``VmHWM`` is recorded too) and
   writes ``recipes/export_peak_rss.json``;
4. deletes the synthetic files; steps 1-3 repeat for each ``--base-shard-gb`` limit (the same weights cut into
   fewer, larger shards), to show whether the peak follows the shard size.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def text_config(layers: int, hidden: int):
    from hf_openjev.checkpoint.tiny import tiny_text_config

    # Qwen3.5-2B-like geometry (docs/checkpoints.md), untied embeddings so the base also has an lm_head to drop.
    return tiny_text_config(
        vocab_size=248320, hidden_size=hidden, num_layers=layers, intermediate_size=3 * hidden,
        num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=False,
    )


def write_synthetic(root: Path, layers: int, hidden: int, shard_bytes: int) -> dict:
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5TextModel

    from hf_openjev.checkpoint.package import PUBLISHED_TARGETS
    from hf_openjev.checkpoint.tiny import build_tiny_tokenizer

    config = text_config(layers, hidden)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Qwen3_5TextModel(config).state_dict().items()}
    entries = [(f"model.language_model.{k}", s) for k, s in shapes.items()]
    entries += [("lm_head.weight", (config.vocab_size, hidden)), ("mtp.fc.weight", (hidden, 2 * hidden))]

    base = root / "base"
    base.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    shards: list[list[tuple[str, tuple]]] = [[]]
    used = 0
    for name, shape in entries:
        size = math.prod(shape) * 2
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append((name, shape))
        used += size
    weight_map = {}
    for i, group in enumerate(shards, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            t = torch.empty(shape, dtype=torch.bfloat16)
            t.normal_(0.0, 0.02, generator=generator)
            tensors[name] = t
            weight_map[name] = filename
        save_file(tensors, str(base / filename), metadata={"format": "pt"})
        del tensors
    total = sum(math.prod(s) * 2 for _, s in entries)
    (base / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                   "weight_map": weight_map}))
    text = config.to_dict()
    text.pop("architectures", None)
    (base / "config.json").write_text(json.dumps({"model_type": "qwen3_5", "text_config": text,
                                                  "architectures": ["Qwen3_5ForConditionalGeneration"]}))
    build_tiny_tokenizer().save_pretrained(str(base))

    ckpt = root / "package" / "checkpoint"
    (ckpt / "adapter").mkdir(parents=True)
    lora = {}
    for name, shape in shapes.items():
        module = name[: -len(".weight")]
        if name.endswith(".weight") and module.split(".")[-1] in PUBLISHED_TARGETS and len(shape) == 2:
            key = f"base_model.model.model.language_model.{module}"
            lora[f"{key}.lora_A.weight"] = torch.randn(8, shape[1], generator=generator) * 0.01
            lora[f"{key}.lora_B.weight"] = torch.randn(shape[0], 8, generator=generator) * 0.01
    save_file(lora, str(ckpt / "adapter" / "adapter_model.safetensors"))
    (ckpt / "adapter" / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(PUBLISHED_TARGETS)}))
    torch.save({"weight": torch.randn(1, hidden, generator=generator) * 0.1, "bias": torch.zeros(1)}, ckpt / "head.pt")
    (ckpt / "temperature.json").write_text(json.dumps({"temperature": 1.5}))
    (ckpt / "model.json").write_text(json.dumps({"model_id": "open-jev/synthetic", "revision": "synthetic",
                                                 "max_length": 4096, "lora_rank": 8,
                                                 "test_checkpoint": True}))  # no family member's shape
    files = sorted(base.glob("*.safetensors"))
    return {
        "config": {"hidden_size": hidden, "num_hidden_layers": layers, "intermediate_size": 3 * hidden,
                   "vocab_size": config.vocab_size, "layer_types": config.layer_types},
        "base_bytes": sum(p.stat().st_size for p in files),
        "base_shards": [{"file": p.name, "bytes": p.stat().st_size} for p in files],
        "largest_base_shard_bytes": max(p.stat().st_size for p in files),
        "largest_tensor_bytes": max(math.prod(s) * 2 for _, s in entries),
        "largest_tensor": max(entries, key=lambda e: math.prod(e[1]))[0],
        "adapter_bytes": (ckpt / "adapter" / "adapter_model.safetensors").stat().st_size,
        "lora_modules": len(lora) // 2,
    }


CHILD_FLOOR = """
import json, platform
import torch, transformers, peft, safetensors, tqdm
import hf_openjev.export.merge
from hf_openjev.checkpoint.package import read_base_text_config
status = open("/proc/self/status").read()
hwm = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"vm_hwm_bytes": hwm, "versions": {
    "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
    "peft": peft.__version__, "safetensors": safetensors.__version__, "platform": platform.platform()}}))
"""

CHILD_GENERATE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from export_peak_rss import write_synthetic
from pathlib import Path
print(json.dumps(write_synthetic(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))))
"""

CHILD_EXPORT = """
import json, sys, time
from hf_openjev.export.merge import merge_lora
start = time.perf_counter()
report = merge_lora(sys.argv[1], sys.argv[2], sys.argv[3], verify=sys.argv[4] == "1", progress=False)
status = open("/proc/self/status").read()
hwm = int(status.split("VmHWM:")[1].split()[0]) * 1024
print(json.dumps({"seconds": time.perf_counter() - start, "vm_hwm_bytes": hwm, "lines": report.lines(),
                  "shards": report.shards, "tensor_check": report.tensor_check.describe(),
                  "probe": report.probe.describe()}))
"""


def run_child(code: str, *args: str) -> dict:
    """Run ``python -c code args`` and return its JSON output plus its peak RSS (``ru_maxrss`` from wait4)."""
    start = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err_file:
        proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=err_file,
                                cwd=str(REPO), text=True)
        out = proc.stdout.read()  # until the child exits and closes it
        _, status, usage = os.wait4(proc.pid, 0)  # reap it ourselves: this gives the child's own rusage
        proc.returncode = os.waitstatus_to_exitcode(status)
        proc.stdout.close()
        err_file.seek(0)
        err = err_file.read()
    if proc.returncode != 0:
        raise RuntimeError(f"child failed ({proc.returncode}):\n{err[-4000:]}")
    result = json.loads(out.strip().splitlines()[-1])
    result["peak_rss_bytes"] = usage.ru_maxrss * 1024  # Linux: kilobytes
    result["wall_seconds"] = time.perf_counter() - start
    result["user_cpu_seconds"] = usage.ru_utime
    return result


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"hf_openjev_commit": commit, "cpus": os.cpu_count(), "ram_bytes": mem}


def measure(root: Path, layers: int, hidden: int, shard_gb: float, floor: dict) -> dict:
    """Write one synthetic base with shards of at most ``shard_gb`` and export it twice (verify off / on)."""
    # Everything heavy runs in child processes: on Linux a child's ru_maxrss starts from its parent's RSS at
    # fork/exec time, so this parent stays a small pure-Python process (it never imports torch).
    synthetic = run_child(CHILD_GENERATE, str(HERE), str(root), str(layers), str(hidden), str(int(shard_gb * 1e9)))
    synthetic["write_seconds"] = synthetic.pop("wall_seconds")
    synthetic["generator_peak_rss_bytes"] = synthetic.pop("peak_rss_bytes")
    synthetic.pop("user_cpu_seconds")
    print(f"synthetic base (shards <= {shard_gb} GB): {synthetic['base_bytes'] / 1e9:.2f} GB in "
          f"{len(synthetic['base_shards'])} shard(s), largest shard {synthetic['largest_base_shard_bytes'] / 1e9:.2f} GB, "
          f"largest tensor {synthetic['largest_tensor']} {synthetic['largest_tensor_bytes'] / 1e9:.2f} GB, adapter "
          f"{synthetic['adapter_bytes'] / 1e6:.1f} MB", flush=True)
    runs = {}
    for label, verify in (("verify_off", "0"), ("verify_on", "1")):
        out = root / f"export-{label}"
        run = run_child(CHILD_EXPORT, str(root / "base"), str(root / "package"), str(out), verify)
        run["export_bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        run["peak_rss_above_import_floor_bytes"] = run["peak_rss_bytes"] - floor["peak_rss_bytes"]
        runs[label] = run
        print(f"  export {label}: peak RSS {run['peak_rss_bytes'] / 1e9:.3f} GB "
              f"({run['peak_rss_above_import_floor_bytes'] / 1e9:.3f} GB above the import floor), "
              f"{run['seconds']:.1f} s", flush=True)
        for line in run["lines"]:
            print("     ", line)
        shutil.rmtree(out)
    shutil.rmtree(root / "base")
    shutil.rmtree(root / "package")
    return {"base_shard_limit_gb": shard_gb, "synthetic": synthetic, "runs": runs}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="where to write the synthetic base (default: a new directory in /tmp)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--base-shard-gb", type=float, nargs="+", default=[2.5, 5.0],
                        help="base shard size limits to measure (one synthetic base each)")
    parser.add_argument("--json", default=str(HERE / "export_peak_rss.json"))
    args = parser.parse_args(argv)

    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="hf_openjev_rss_", dir="/tmp"))
    root.mkdir(parents=True, exist_ok=True)
    need = 2.2 * (2 * 248320 * args.hidden * 2 + args.layers * 60e6 * 2)
    free = shutil.disk_usage(root).free
    if free < need:
        print(f"not enough disk space in {root}: need about {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free")
        return 1
    try:
        floor = run_child(CHILD_FLOOR)
        print(f"import floor (torch, transformers, peft, hf_openjev.export): peak RSS "
              f"{floor['peak_rss_bytes'] / 1e9:.3f} GB", flush=True)
        cases = [measure(root / f"shards-{gb:g}GB", args.layers, args.hidden, gb, floor) for gb in args.base_shard_gb]
        result = {
            "command": " ".join(["python", "recipes/export_peak_rss.py", *(argv if argv is not None else sys.argv[1:])]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "versions": dict(floor.pop("versions"), **machine()),
            "import_floor": floor,
            "cases": cases,
            "parent_peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "summary": [
                {"base_gb": c["synthetic"]["base_bytes"] / 1e9,
                 "base_shards": len(c["synthetic"]["base_shards"]),
                 "largest_base_shard_gb": c["synthetic"]["largest_base_shard_bytes"] / 1e9,
                 "largest_tensor_gb": c["synthetic"]["largest_tensor_bytes"] / 1e9,
                 "adapter_gb": c["synthetic"]["adapter_bytes"] / 1e9,
                 "export_gb": c["runs"]["verify_on"]["export_bytes"] / 1e9,
                 "import_floor_peak_rss_gb": floor["peak_rss_bytes"] / 1e9,
                 "peak_rss_gb_verify_off": c["runs"]["verify_off"]["peak_rss_bytes"] / 1e9,
                 "peak_rss_gb_verify_on": c["runs"]["verify_on"]["peak_rss_bytes"] / 1e9,
                 "seconds_verify_off": c["runs"]["verify_off"]["seconds"],
                 "seconds_verify_on": c["runs"]["verify_on"]["seconds"]}
                for c in cases
            ],
        }
        Path(args.json).write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {args.json}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
