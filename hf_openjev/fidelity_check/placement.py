"""Where the fp32 oracle runs: one GPU, several GPUs (a device map through accelerate), one GPU with the layers
that do not fit offloaded to the host and streamed in layer by layer (accelerate's offload), or the CPU.

:func:`choose_oracle_placement` decides from the fp32 size of the export (read from its safetensors headers, no
weights loaded), the largest one-candidate forward's activations and the free memory of each GPU and of the
host; :func:`estimate_oracle_seconds` gives a rough time from assumed device rates (the progress bar then shows
the measured one); :func:`load_oracle_model` loads the export in fp32 where the placement says.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PLACEMENTS = ("auto", "cpu", "cuda", "multi-gpu", "offload")
GPU_RESERVE_FRACTION = 0.05  # of each GPU's free memory, left for the allocator's fragmentation and workspaces
HOST_RESERVE_FRACTION = 0.10
# assumed sustained rates of a one-candidate fp32 forward (TF32 off), for the estimate only
ASSUMED_GPU_FP32_FLOPS = 4e13
ASSUMED_CPU_FP32_FLOPS_PER_THREAD = 2e10
ASSUMED_HOST_TO_GPU_BYTES_PER_S = 2e10
_LAYER = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class OraclePlacement:
    """``kind``: cpu, cuda, multi-gpu or offload; ``device_map``: the backbone's module -> device (multi-gpu and
    offload; "cpu" entries are offloaded, run on GPU 0); ``offloaded_bytes``: fp32 bytes streamed per forward."""

    kind: str
    fp32_bytes: int
    reason: str
    device_map: dict | None = None
    offloaded_bytes: int = 0

    def describe(self) -> str:
        return f"fp32 oracle on {self.kind} ({self.fp32_bytes / 1e9:.1f} GB of fp32 weights): {self.reason}"


def fp32_sizes(export_dir: str | Path) -> tuple[dict[int, int], int]:
    """(fp32 bytes per decoder layer index, fp32 bytes of everything else) of an export, from its headers."""
    from ..checkpoint.files import base_weight_files, read_safetensors_headers, text_key

    layers: dict[int, int] = defaultdict(int)
    other = 0
    for path in base_weight_files(Path(export_dir)):
        for key, (shape, _dtype) in read_safetensors_headers(path).items():
            name = text_key(key)
            if name is None or name.endswith("_scale") or name.endswith("weight_scale"):
                continue
            numel = 1
            for d in shape:
                numel *= d
            match = _LAYER.match(name)
            if match:
                layers[int(match.group(1))] += 4 * numel
            else:
                other += 4 * numel
    return dict(layers), other


def activation_bytes(text_config, longest_tokens: int) -> int:
    """A bound on one fp32 forward's activations for a sequence of ``longest_tokens``: SDPA's math backend holds
    the [heads, L, L] scores and their softmax; the MLP its [L, intermediate] gate, up and product."""
    n = int(longest_tokens)
    attention = 2 * text_config.num_attention_heads * n * n * 4
    mlp = 3 * n * text_config.intermediate_size * 4
    return attention + mlp + 8 * n * text_config.hidden_size * 4


def plan_device_map(layer_bytes: dict[int, int], other_bytes: int, budgets: list[int], *,
                    offload: bool) -> dict | None:
    """Decoder layers in order onto GPUs 0, 1, ... within each ``budgets[i]`` bytes (embeddings, final norm and
    rotary tables on GPU 0). ``offload``: what does not fit goes to "cpu" (streamed to GPU 0 when it runs); else
    None when it does not fit."""
    device_map = {"embed_tokens": 0, "rotary_emb": 0, "norm": 0}
    left = list(budgets)
    left[0] -= other_bytes
    gpu = 0
    for index in sorted(layer_bytes):
        size = layer_bytes[index]
        while gpu < len(left) and left[gpu] < size:
            gpu += 1
        if gpu < len(left):
            device_map[f"layers.{index}"] = gpu
            left[gpu] -= size
        elif offload:
            device_map[f"layers.{index}"] = "cpu"
        else:
            return None
    if left[0] < 0:
        return None
    return device_map


def choose_oracle_placement(*, requested: str, layer_bytes: dict[int, int], other_bytes: int,
                            activations: int, gpu_free: list[int], host_free: int) -> OraclePlacement:
    """The placement ``requested`` (``auto``: the first that fits of cuda, multi-gpu, offload; cpu without a
    GPU), or a one-line ``ValueError`` when it cannot run here."""
    if requested not in PLACEMENTS:
        raise ValueError(f"--oracle-device must be one of {', '.join(PLACEMENTS)}, got {requested!r}")
    total = sum(layer_bytes.values()) + other_bytes
    host = int(host_free * (1 - HOST_RESERVE_FRACTION))
    gb = 1e9
    if requested == "cpu" or (requested == "auto" and not gpu_free):
        if total + activations > host:
            raise ValueError(f"the fp32 model needs {total / gb:.1f} GB but the host has {host / gb:.1f} GB free"
                             + ("" if gpu_free else " and there is no GPU") + "; run it on a machine with more memory")
        return OraclePlacement("cpu", total, "no GPU" if not gpu_free else "asked for")
    if not gpu_free:
        raise ValueError(f"--oracle-device {requested} needs a CUDA GPU and none is visible; use cpu or auto")
    budgets = [int(f * (1 - GPU_RESERVE_FRACTION)) - activations for f in gpu_free]  # every GPU runs attention
    fits_one = total <= budgets[0]
    if requested == "cuda" or (requested == "auto" and fits_one):
        if not fits_one:
            raise ValueError(f"the fp32 model ({total / gb:.1f} GB) and its activations ({activations / gb:.1f} GB) "
                             f"do not fit GPU 0 ({gpu_free[0] / gb:.1f} GB free); use multi-gpu, offload or auto")
        return OraclePlacement("cuda", total, f"fits GPU 0 ({gpu_free[0] / gb:.1f} GB free)")
    spread = plan_device_map(layer_bytes, other_bytes, budgets, offload=False) if len(budgets) > 1 else None
    if requested == "multi-gpu" or (requested == "auto" and spread is not None):
        if spread is None:
            raise ValueError(f"the fp32 model ({total / gb:.1f} GB) does not fit the {len(gpu_free)} GPU(s) "
                             f"({sum(gpu_free) / gb:.1f} GB free together); use offload or auto")
        used = sorted({d for d in spread.values()})
        return OraclePlacement("multi-gpu", total, f"spread over GPUs {used} ({sum(gpu_free) / gb:.1f} GB free)",
                               device_map=spread)
    offloaded = plan_device_map(layer_bytes, other_bytes, budgets[:1], offload=True)
    if offloaded is None:
        raise ValueError(f"not even the embeddings and one layer fit GPU 0 ({gpu_free[0] / gb:.1f} GB free); use cpu")
    streamed = sum(layer_bytes[int(k.split(".")[1])] for k, d in offloaded.items() if d == "cpu")
    if streamed > host:
        raise ValueError(f"offloading needs {streamed / gb:.1f} GB of host memory, {host / gb:.1f} GB are free")
    kept = sum(1 for k, d in offloaded.items() if k.startswith("layers.") and d == 0)
    return OraclePlacement("offload", total, f"{kept} of {len(layer_bytes)} layers on GPU 0, the others streamed "
                           f"from the host ({streamed / gb:.1f} GB per forward)", device_map=offloaded,
                           offloaded_bytes=streamed)


def measure_free_memory() -> tuple[list[int], int]:
    """(free bytes of each visible CUDA GPU, available host bytes)."""
    import psutil
    import torch

    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())]
    return gpus, int(psutil.virtual_memory().available)


def estimate_oracle_seconds(placement: OraclePlacement, *, tokens: int, sequences: int, threads: int = 1) -> float:
    """A rough time for ``tokens`` tokens in ``sequences`` forwards: 2 x parameters x tokens at an assumed rate,
    plus, offloaded, the streamed bytes of every forward over the host link."""
    params = placement.fp32_bytes / 4
    flops = 2.0 * params * tokens
    if placement.kind == "cpu":
        return flops / (ASSUMED_CPU_FP32_FLOPS_PER_THREAD * max(1, threads))
    seconds = flops / ASSUMED_GPU_FP32_FLOPS
    return seconds + sequences * placement.offloaded_bytes / ASSUMED_HOST_TO_GPU_BYTES_PER_S


def load_oracle_model(export_dir: str | Path, placement: OraclePlacement):
    """The export in fp32 where ``placement`` says (a :class:`~hf_openjev.model.JevModel`; with a device map its
    head sits where the embeddings are, GPU 0, and takes its input from wherever the final norm ran)."""
    from ..model import load_export

    if placement.kind in ("cpu", "cuda"):
        return load_export(export_dir, dtype="float32", device=placement.kind)
    model = load_export(export_dir, dtype="float32", device=dict(placement.device_map))
    main = placement.device_map["embed_tokens"]  # where the forward starts (GPU 0; "cpu" in a CPU-only map)
    model.head.to("cpu" if main == "cpu" else f"cuda:{main}")
    model.head.register_forward_pre_hook(lambda module, args: tuple(a.to(module.weight.device) for a in args))
    return model
