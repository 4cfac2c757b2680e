"""GPU kernels registered as ``torch.ops.hf_openjev.*`` custom ops, each with a plain-torch reference."""
