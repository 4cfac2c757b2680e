"""skinny_linear: the reference against float64 and F.linear, the CPU op, the limits, opcheck, the fake, the
launch-configuration tables (CPU); GPU: the Triton kernel against the fp32 reference at the 27B shapes, split-K
determinism, graph capture, strided rows, opcheck."""

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from hf_openjev.ops import skinny_gemm_configs as cfg
from hf_openjev.ops._checks import capture_replay, max_errors
from hf_openjev.ops.skinny_linear import check_skinny_inputs, skinny_linear_reference

OP = torch.ops.hf_openjev.skinny_linear
DTYPES = [torch.bfloat16, torch.float16]
# (out, in) of the 27B's projections as the fast path stacks them (recipes/benchlib/shapes.py gemm_shapes("27b");
# tests/test_skinny_gemm_check_recipe.py checks they agree); o_proj has out_proj's shape
SHAPES_27B = {"in_proj": (16480, 5120), "out_proj": (5120, 6144), "qkv": (14336, 5120), "gate_up": (34816, 5120),
              "down": (5120, 17408)}
SHAPES_9B = [(12352, 4096), (4096, 4096), (10240, 4096), (24576, 4096), (4096, 12288)]  # in, out/o, qkv, up, down
SHAPES_2B = [(8224, 2048), (2048, 2048), (5120, 2048), (12288, 2048), (2048, 6144)]
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}  # one unit at the largest |y|, relative


def _inputs(m, k, n, dtype=torch.bfloat16, seed=0, device="cpu"):
    """x [m, k] ~ N(0, 1) and w [n, k] ~ N(0, 0.02^2), drawn on ``device`` (the 27B's weights are large)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=device).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=device) * 0.02).to(dtype)
    return x, w


@pytest.mark.parametrize("m, k, n", [(1, 16, 16), (7, 64, 96), (107, 512, 320), (256, 128, 48)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_the_fp32_product_rounded_once(m, k, n, dtype):
    x, w = _inputs(m, k, n, dtype, seed=m + k)
    got = skinny_linear_reference(x, w)
    exact = x.double() @ w.double().t()
    assert got.dtype == dtype and got.shape == (m, n)
    # half a unit of the output dtype of each element, plus fp32 summation order
    bound = exact.abs() * ULP[dtype] / 2 + exact.abs().max() * 1e-6
    assert ((got.double() - exact).abs() <= bound).all()
    # F.linear in the 16-bit dtype (its own accumulation and rounding) lands within a unit or two of it
    assert max_errors(F.linear(x, w), got)[1] <= 2 * ULP[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_op_is_the_reference(dtype):
    x, w = _inputs(37, 96, 160, dtype)
    y = OP(x, w)
    assert torch.equal(y, skinny_linear_reference(x, w)) and y.abs().max() > 0.1
    assert OP(x[:0], w).shape == (0, 160)  # no rows


def _bad(case):
    x, w = _inputs(5, 32, 16)
    return {
        "x 3-d": ((x.reshape(1, 5, 32), w), "must be \\[M, K\\]"),
        "weight 1-d": ((x, w[0]), "must be \\[M, K\\]"),
        "fp32": ((x.float(), w.float()), "bf16 or both fp16"),
        "mixed dtypes": ((x, w.half()), "bf16 or both fp16"),
        "K mismatch": ((x[:, :16], w), "input features"),
        "too many rows": ((torch.zeros(257, 32, dtype=torch.bfloat16), w), "M=257"),
        "K not 16-multiple": ((torch.zeros(5, 24, dtype=torch.bfloat16), torch.zeros(16, 24, dtype=torch.bfloat16)),
                              "K=24"),
        "N not 16-multiple": ((x, w[:8]), "N=8"),
        "devices": ((x, w.to("meta")), "one device"),
    }[case]


@pytest.mark.parametrize("case", ["x 3-d", "weight 1-d", "fp32", "mixed dtypes", "K mismatch", "too many rows",
                                  "K not 16-multiple", "N not 16-multiple", "devices"])
def test_limits_are_refused_with_a_one_line_message(case):
    args, message = _bad(case)
    for fn in (OP, skinny_linear_reference, check_skinny_inputs):
        with pytest.raises(ValueError, match=message) as info:
            fn(*args)
        assert "\n" not in str(info.value)
    if case != "devices":
        with pytest.raises(ValueError, match=message):  # the fake impl checks too (torch.compile sees the error)
            with FakeTensorMode() as mode:
                OP(*(mode.from_tensor(a) for a in args))


def test_the_limits_admit_256_rows_and_16_multiples():
    x, w = _inputs(256, 16, 16)
    assert OP(x, w).shape == (256, 16)
    check_skinny_inputs(*_inputs(1, 17408, 5120)[:1], torch.empty(5120, 17408, dtype=torch.bfloat16))


@pytest.mark.parametrize("m", [1, 33, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_opcheck(m, dtype):
    torch.library.opcheck(OP, _inputs(m, 64, 48, dtype, seed=m))


def test_fake_gives_the_shape_and_dtype():
    x, w = _inputs(107, 64, 96, torch.float16)
    with FakeTensorMode() as mode:
        y = OP(mode.from_tensor(x), mode.from_tensor(w))
    assert y.shape == (107, 96) and y.dtype == torch.float16


def test_compile_fullgraph():
    x, w = _inputs(19, 64, 32)

    def f(x, w):
        return OP(x * 2, w) + 1

    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="aot_eager")(x, w), f(x, w))


# ------------------------------------------------------------------------------------------- the config tables

def test_m_buckets_are_powers_of_two_from_16_to_256():
    assert [cfg.block_m_for(m) for m in (0, 1, 16, 17, 33, 64, 65, 107, 128, 129, 256)] == \
        [16, 16, 16, 32, 64, 64, 128, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="M=257"):
        cfg.block_m_for(257)


@pytest.mark.parametrize("shapes", [list(SHAPES_27B.values()), SHAPES_9B, SHAPES_2B], ids=["27b", "9b", "2b"])
def test_every_model_gemm_gets_a_buildable_config_at_every_m_one_per_bucket(shapes):
    for n, k in shapes:
        for m in range(1, cfg.MAX_M + 1):
            config = cfg.choose_config(m, n, k)
            cfg.check_config(config, cfg.block_m_for(m), k)  # K splits into whole steps, shared memory fits
            assert config.split_k == 1 or k // (config.split_k * config.block_k) >= cfg.MIN_K_STEPS
            assert config == cfg.choose_config(cfg.block_m_for(m), n, k)  # one build per bucket (warm-up)


def test_narrow_outputs_are_split_over_k_and_wide_ones_are_not():
    """out_proj / down (N=5120): 40 tiles of 128 rows for 132 SMs, so K is split; in_proj's 129 tiles fill them."""
    for m in (1, 16, 107):
        assert cfg.choose_config(m, 5120, 17408).split_k > 1 and cfg.choose_config(m, 5120, 6144).split_k > 1
        assert cfg.choose_config(m, 16480, 5120).split_k == 1
    assert cfg.tail_cost(132, 132) == 0.0 and cfg.tail_cost(264, 132) == 0.0
    assert cfg.tail_cost(40, 132) > 0.5  # 40 programs stream at 80/132 of the memory's rate
    assert cfg.tail_cost(272, 132) > cfg.tail_cost(1088, 132) > 0.0  # a partial wave costs less among more


def test_overrides_win_and_config_names_round_trip(monkeypatch):
    config = cfg.SkinnyConfig(64, 64, 4, 4, 3)
    assert cfg.parse_config(config.name) == config and config.name == "bn64-bk64-s4-w4-p3"
    monkeypatch.setitem(cfg.OVERRIDES, (128, 5120, 6144), config)
    assert cfg.choose_config(107, 5120, 6144) == config and cfg.choose_config(64, 5120, 6144) != config
    with pytest.raises(ValueError, match="bn<block_n>"):
        cfg.parse_config("bn64-bk64-w4-p3")


@pytest.mark.parametrize("config, block_m, k, message", [
    (cfg.SkinnyConfig(96, 64, 1, 4, 3), 16, 512, "block_n=96"),
    (cfg.SkinnyConfig(128, 128, 3, 4, 3), 16, 512, "split_k \\* block_k"),
    (cfg.SkinnyConfig(128, 64, 1, 2, 3), 16, 512, "num_warps=2"),
    (cfg.SkinnyConfig(128, 128, 1, 8, 4), 256, 512, "shared memory"),
])
def test_bad_configs_are_refused(config, block_m, k, message):
    with pytest.raises(ValueError, match=message):
        cfg.check_config(config, block_m, k)


# ------------------------------------------------------------------------------------------------------- GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GPU_ROWS = [1, 16, 37, 107, 128, 256]  # 37: an odd M in the 64 bucket


def _fp32_reference(x, w):
    """skinny_linear_reference on the device with fp32 matmuls in full fp32 (TF32 off, whatever ran before)."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return skinny_linear_reference(x, w)
    finally:
        torch.set_float32_matmul_precision(saved)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", GPU_ROWS)
@pytest.mark.parametrize("shape", list(SHAPES_27B))
def test_cuda_matches_reference_at_27b(shape, m):
    n, k = SHAPES_27B[shape]
    x, w = _inputs(m, k, n, seed=m, device="cuda")
    y = OP(x, w)
    ref = _fp32_reference(x, w)
    abs_err, rel_err = max_errors(y, ref)
    config = cfg.choose_config(m, n, k)
    print(f"{shape} M={m} {config.name}: max |kernel - reference| {abs_err:.3e} ({rel_err:.3e} of max |y|)")
    assert y.dtype == torch.bfloat16 and y.shape == (m, n) and y.isfinite().all()
    assert rel_err <= ULP[torch.bfloat16]  # the same fp32 sums in another order, each rounded once
    # cuBLAS computes the same product (its split-K may reduce in bf16: a looser bound than ours)
    assert max_errors(y, F.linear(x, w))[1] <= 2**-4
    if config.split_k > 1:
        assert torch.equal(OP(x, w), y)  # the splits are summed in a fixed order: the same bits every run


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", ["bn64-bk64-s1-w4-p3", "bn128-bk64-s4-w8-p3", "bn32-bk128-s2-w4-p2"])
def test_cuda_configs_give_the_reference(config, dtype):
    from hf_openjev.ops.skinny_gemm_triton import skinny_gemm

    x, w = _inputs(45, 1024, 400, dtype, seed=3, device="cuda")  # 400 rows: a partial last N tile
    y = skinny_gemm(x, w, cfg.parse_config(config))
    assert max_errors(y, _fp32_reference(x, w))[1] <= ULP[dtype]


@pytest.mark.gpu
@needs_cuda
def test_cuda_strided_rows_no_rows_and_opcheck():
    wide, w = _inputs(64, 1024, 256, seed=4, device="cuda")
    x = wide[:, 256:768]  # rows 1024 apart, the last dimension contiguous
    assert torch.equal(OP(x, w[:, :512].contiguous()), OP(x.contiguous(), w[:, :512].contiguous()))
    assert OP(x[:0], w[:, :512].contiguous()).shape == (0, 256)
    torch.library.opcheck(OP, _inputs(19, 256, 128, seed=5, device="cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shape", ["qkv", "down"])  # one without and one with split-K
def test_cuda_graph_capture_replay(shape):
    n, k = SHAPES_27B[shape]
    xa, w = _inputs(107, k, n, seed=6, device="cuda")
    xb, _ = _inputs(107, k, n, seed=7, device="cuda")
    xb[90:] = 0  # the padded rows of a bucket
    replayed, eager = capture_replay(lambda x, weight: OP(x, weight), dict(x=xa, weight=w), dict(x=xb, weight=w))
    assert torch.equal(replayed, eager) and (replayed[90:] == 0).all()
