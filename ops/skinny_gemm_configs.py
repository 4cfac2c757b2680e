"""Launch configurations of the skinny GEMM (``skinny_gemm_triton.py``), chosen from tables, never autotuned at
run time (a forward's warm-up compiles one build per (M bucket, config) it meets and nothing else: issue 39).

A GEMM y [M, N] = x [M, K] @ w [N, K]^T with M <= 256 is named by its M bucket, ``BLOCK_M`` = the next power of two
>= M (16 at least), and by (N, K). Its configuration:

- ``BUCKETS[block_m]``: the tile (BLOCK_N, BLOCK_K), warps and pipeline stages of every GEMM of that bucket;
- the split of K over programs (``split_k``): one program per (N tile, K split), so that the ~132 SMs of an H100 or
  H200 get full waves when N / BLOCK_N alone is too few (the 27B's out_proj and down, N=5120, have 40 tiles of
  128): :func:`choose_split` scores each split by the time its last, partial wave adds (:func:`tail_cost`) plus
  the cost of the fp32 partial sums it adds (written and read back once: 8 * split * M bytes per column against
  2 * K of weights) and of the second launch that sums them;
- ``OVERRIDES[(block_m, N, K)]``: measured exceptions (``recipes/skinny_gemm_check.py --configs`` times the
  alternatives per shape and prints the lines to paste here); empty until the GPU has been asked.

Shared memory per program: ``stages * (BLOCK_N + BLOCK_M) * BLOCK_K * 2`` bytes (both operands' tiles, 16 bits);
:func:`check_config` refuses a configuration over ``SMEM_BYTES`` before Triton would fail to build it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_M = 256  # rows the kernel takes (BLOCK_M up to 256); longer packs belong to cuBLAS
SMS = 132  # streaming multiprocessors of an H100 SXM and of an H200
SMEM_BYTES = 227 * 1024  # shared memory one program may use on Hopper
SPLITS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)  # K splits considered
MIN_K_STEPS = 4  # each split walks at least this many BLOCK_K steps (the pipeline needs a few to fill)
SPLIT_LAUNCH_COST = 0.03  # the second launch (sum of the splits), as a fraction of the GEMM's time
# how many times its fair share of the memory bandwidth (total / slots) one program can draw alone: assumed, not
# measured (the recipe's --configs sweep is the measurement); it sets how much a partial last wave costs
ALPHA = 2.0


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch: tile (block_n rows of w by block_k), K splits, warps, pipeline stages."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int

    @property
    def name(self) -> str:
        return f"bn{self.block_n}-bk{self.block_k}-s{self.split_k}-w{self.num_warps}-p{self.num_stages}"


# block_m -> (block_n, block_k, num_warps, num_stages): smem 110-196 KB; an [N, M] fp32 accumulator of at most
# 128 registers a thread (block_n * block_m / (32 * warps))
BUCKETS: dict[int, tuple[int, int, int, int]] = {
    16: (128, 128, 4, 4),
    32: (128, 128, 4, 4),
    64: (128, 128, 4, 3),
    128: (128, 64, 8, 4),
    256: (128, 64, 8, 3),
}
# (block_m, N, K) -> a measured configuration (paste from recipes/skinny_gemm_check.py --configs)
OVERRIDES: dict[tuple[int, int, int], SkinnyConfig] = {}


def block_m_for(m: int) -> int:
    """The M bucket: the next power of two >= m, at least 16 (m 1..256)."""
    if not 0 <= m <= MAX_M:
        raise ValueError(f"skinny_linear: M={m} rows; the kernel takes 0..{MAX_M}")
    return max(16, 1 << max(m - 1, 0).bit_length())


def parse_config(name: str) -> SkinnyConfig:
    """``bn128-bk64-s2-w8-p3`` -> SkinnyConfig(128, 64, 2, 8, 3) (what :attr:`SkinnyConfig.name` writes)."""
    parts = name.split("-")
    prefixes = ("bn", "bk", "s", "w", "p")
    if len(parts) != 5 or not all(p.startswith(x) and p[len(x):].isdigit() for p, x in zip(parts, prefixes)):
        raise ValueError(f"config {name!r}: write it as bn<block_n>-bk<block_k>-s<split_k>-w<warps>-p<stages>")
    return SkinnyConfig(*(int(p[len(x):]) for p, x in zip(parts, prefixes)))


def smem_bytes(config: SkinnyConfig, block_m: int) -> int:
    """Shared memory of one program: ``stages`` buffers of the w and x tiles (16 bits)."""
    return config.num_stages * (config.block_n + block_m) * config.block_k * 2


def check_config(config: SkinnyConfig, block_m: int, k: int) -> None:
    """A ValueError unless ``config`` can run a GEMM of bucket ``block_m`` and depth ``k``: powers of two
    block_n >= 16 and block_k >= 16, K a multiple of split_k * block_k (every split walks whole steps), warps 4
    or 8, stages >= 1, shared memory within ``SMEM_BYTES``."""
    for name, v in (("block_n", config.block_n), ("block_k", config.block_k)):
        if v < 16 or v & (v - 1):
            raise ValueError(f"skinny_linear: {name}={v} must be a power of two >= 16")
    if config.split_k < 1 or k % (config.split_k * config.block_k):
        raise ValueError(f"skinny_linear: K={k} is not a multiple of split_k * block_k = "
                         f"{config.split_k} * {config.block_k}")
    if config.num_warps not in (4, 8) or config.num_stages < 1:
        raise ValueError(f"skinny_linear: num_warps={config.num_warps} must be 4 or 8, num_stages >= 1")
    if smem_bytes(config, block_m) > SMEM_BYTES:
        raise ValueError(f"skinny_linear: {config.name} at BLOCK_M={block_m} needs {smem_bytes(config, block_m)} "
                         f"bytes of shared memory (at most {SMEM_BYTES})")


def programs_per_sm(config: SkinnyConfig, block_m: int) -> int:
    """How many programs of this configuration one SM holds at once, by shared memory (at least 1)."""
    return max(1, SMEM_BYTES // smem_bytes(config, block_m))


def tail_cost(programs: int, slots: int) -> float:
    """The time a partial last wave adds to a memory-bound launch, as a fraction of the whole: ``programs`` equal
    programs over ``slots`` (SMs x programs an SM holds); a full wave streams at the full bandwidth, the last
    wave's ``t`` programs at ``min(1, ALPHA * t / slots)`` of it, each program holding ``1 / programs`` of the
    bytes. 0 when the last wave is full or wide enough to saturate the memory."""
    t = programs % slots
    return 0.0 if t == 0 else slots / (ALPHA * programs) * max(0.0, 1.0 - ALPHA * t / slots)


def split_cost(tiles: int, split: int, m: int, k: int, per_sm: int) -> float:
    """:func:`tail_cost` of ``tiles * split`` programs, plus for split > 1 the partial sums' traffic (relative
    to the weights' 2 * K bytes a column: 8 * split * m) and the second launch."""
    cost = tail_cost(tiles * split, SMS * per_sm)
    return cost if split == 1 else cost + 4.0 * split * m / k + SPLIT_LAUNCH_COST


def choose_split(m: int, n: int, k: int, block_n: int, block_k: int, per_sm: int) -> int:
    """The K split of least :func:`split_cost` among ``SPLITS`` that divide K into whole steps of block_k,
    at least ``MIN_K_STEPS`` a split (ties: the smaller split)."""
    tiles = -(-n // block_n)
    best, best_cost = 1, split_cost(tiles, 1, m, k, per_sm)
    for split in SPLITS[1:]:
        if k % (split * block_k) or k // (split * block_k) < MIN_K_STEPS:
            continue
        cost = split_cost(tiles, split, m, k, per_sm)
        if cost < best_cost - 1e-9:
            best, best_cost = split, cost
    return best


def choose_config(m: int, n: int, k: int) -> SkinnyConfig:
    """The configuration of y [m, n] = x [m, k] @ w [n, k]^T: an override if one is measured, else the bucket's
    tile and warps with :func:`choose_split` at the bucket's top row count (so every M of a bucket shares one
    build); block_k halves (to 16 at least) until it divides K."""
    block_m = block_m_for(m)
    if (block_m, n, k) in OVERRIDES:
        return OVERRIDES[(block_m, n, k)]
    block_n, block_k, warps, stages = BUCKETS[block_m]
    while k % block_k and block_k > 16:
        block_k //= 2
    base = SkinnyConfig(block_n, block_k, 1, warps, stages)
    split = choose_split(block_m, n, k, block_n, block_k, programs_per_sm(base, block_m))
    return SkinnyConfig(block_n, block_k, split, warps, stages)
