"""Gated DeltaNet prefill for short sequences in one kernel: ``torch.ops.hf_openjev.gdn_prefill_short``.

Same arguments, results and math as ``torch.ops.hf_openjev.gdn_prefill`` (``gdn_prefill.py``), so a level can use
either: CPU runs the same fp32 reference (``gdn_prefill_reference``); CUDA runs two Triton launches
(``gdn_wy_triton.py``: the chunk-parallel WY prep, then a program per value head, Dv block and sequence walking
its chunks of 64 with the fp32 state on chip) instead of fla's six chunked kernels. ``gdn_short_triton.py``, the
first one-launch design, stays for comparison in ``recipes/gdn_short_check.py``. ``chunk_indices`` and ``chunk_offsets`` are accepted for parity and unused: the kernel reads
the sequence bounds from ``cu_seqlens`` on the device, so it needs no host metadata and is graph-capturable.

:func:`use_short_gdn` says which of the two ops a level should call, from its longest sequence, and
:func:`short_gdn_fits` whether the kernel takes the model's head dims (the forward's ``short_gdn_tokens`` option
asks both, ``patches/packed_candidates.py``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from hf_openjev.ops.gdn_prefill import check_gdn_inputs, fake_gdn_prefill, gdn_prefill_reference
from hf_openjev.ops.gdn_short_limits import check_short_dims, check_short_shapes

# Longest sequence a level may have for the fused kernel (one program walks its sequence serially, so long
# sequences belong to the chunked op). Provisional: recipes/gdn_short_check.py's table sets it.
SHORT_GDN_MAX_TOKENS = 256
# The CUDA kernels' launch parameters (recipes/gdn_short_check.py compares the alternatives): the state walk's
# Dv block, warps and pipeline stages, the prep's warps, the precision of the products with an fp32 operand.
# CHUNK is fixed.
BLOCK_V, CHUNK, NUM_WARPS, NUM_STAGES, PREP_WARPS, PRECISION = 32, 64, 8, 1, 8, "tf32x3"


def use_short_gdn(max_seq_len: int, threshold: int = SHORT_GDN_MAX_TOKENS) -> bool:
    """True when a level whose longest sequence has ``max_seq_len`` tokens should call ``gdn_prefill_short``."""
    if max_seq_len < 0:
        raise ValueError(f"use_short_gdn: max_seq_len must be >= 0, got {max_seq_len}")
    return max_seq_len <= threshold


def short_gdn_fits(head_k_dim: int, head_v_dim: int) -> bool:
    """True when the CUDA kernel, at this module's launch parameters, takes GDN heads of these dims (Dk, Dv): what
    the packed forward asks before it calls ``gdn_prefill_short`` on any device, so that CPU and GPU choose alike."""
    try:
        check_short_dims(head_k_dim, head_v_dim, BLOCK_V, CHUNK, PRECISION, NUM_WARPS)
    except ValueError:
        return False
    return True


@torch.library.custom_op("hf_openjev::gdn_prefill_short", mutates_args=())
def gdn_prefill_short(
    q: Tensor,  # [T, Hk, Dk]
    k: Tensor,  # [T, Hk, Dk]
    v: Tensor,  # [T, Hv, Dv]
    g: Tensor,  # [T, Hv] fp32 log decay (<= 0)
    beta: Tensor,  # [T, Hv]
    cu_seqlens: Tensor,  # [N+1] int32/int64
    initial_state: Tensor | None,  # [N, Hv, Dk, Dv] fp32; None = zeros
    chunk_indices: Tensor,  # unused (parity with gdn_prefill)
    output_final_state: bool = True,  # False: an empty [0, Hv, Dk, Dv] final state
    chunk_offsets: Tensor | None = None,  # unused (parity with gdn_prefill)
) -> tuple[Tensor, Tensor]:
    """-> (o [T, Hv, Dv] in q.dtype, final_state [N, Hv, Dk, Dv] fp32). Non-CUDA devices run the reference."""
    return gdn_prefill_reference(q, k, v, g, beta, cu_seqlens, initial_state, None, output_final_state)


gdn_prefill_short.register_fake(fake_gdn_prefill)  # the same results as gdn_prefill's, the same fake


@gdn_prefill_short.register_kernel("cuda")
def _gdn_prefill_short_cuda(q, k, v, g, beta, cu_seqlens, initial_state, chunk_indices, output_final_state=True,
                            chunk_offsets=None):
    check_gdn_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    check_short_shapes(q, v, BLOCK_V, CHUNK, PRECISION, NUM_WARPS)
    from hf_openjev.ops.gdn_wy_triton import gdn_wy_forward

    return gdn_wy_forward(q, k, v, g, beta, cu_seqlens, initial_state, output_final_state, block_v=BLOCK_V,
                          num_warps=NUM_WARPS, num_stages=NUM_STAGES, prep_warps=PREP_WARPS, precision=PRECISION)
