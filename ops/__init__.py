"""GPU kernels registered as ``torch.ops.hf_openjev.*`` custom ops, each with a plain-torch reference.

Importing this package registers every op (torch only: fla and triton are imported lazily inside the CUDA
kernels, never here).
"""

from hf_openjev.ops import (  # noqa: F401  (registers)
    causal_conv,
    elementwise,
    fp8_linear,
    gdn_prefill,
    packed_attention,
    skinny_linear,
)
from hf_openjev.ops.varlen import VarlenMetadata, prepare_varlen_metadata

__all__ = ["VarlenMetadata", "prepare_varlen_metadata"]
