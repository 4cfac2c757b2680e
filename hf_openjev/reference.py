"""The reference forward: the stock Transformers model on right-padded batches (the oracle for every fast path)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .work_tokens import DEFAULT_BATCH_TOKENS, check_batch_tokens, split_padded

DEFAULT_BATCH_SIZE = 32


@torch.no_grad()
def score_reference(model, sequences: Sequence[Sequence[int]], *, batch_size: int = DEFAULT_BATCH_SIZE,
                    max_batch_tokens: int = DEFAULT_BATCH_TOKENS) -> list[float]:
    """Score each token sequence independently: final-norm hidden state at its last real token -> fp32 head.

    Sequences run in order, in right-padded batches of up to ``batch_size`` rows whose padded size (rows x the
    longest, ``[B, W]``) is at most ``max_batch_tokens`` (a longer sequence runs alone:
    :func:`hf_openjev.work_tokens.split_padded`); the pad id is 0 and masked out, and a right-padded sequence
    never sees its padding, so each score equals that of the sequence alone.
    """
    if batch_size < 1:
        raise ValueError("batch_size must be at least 1")
    check_batch_tokens(max_batch_tokens, "max_batch_tokens")
    device = model.device
    scores: list[float] = []
    for rows in split_padded([len(s) for s in sequences], max_rows=batch_size, max_tokens=max_batch_tokens):
        batch = [sequences[i] for i in rows]
        lengths = torch.tensor([len(s) for s in batch], device=device)
        width = int(lengths.max())
        ids = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        mask = torch.zeros(len(batch), width, dtype=torch.long, device=device)
        for row, seq in enumerate(batch):
            ids[row, : len(seq)] = torch.as_tensor(seq, device=device)
            mask[row, : len(seq)] = 1
        hidden = model.backbone(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        last = hidden[torch.arange(len(batch), device=device), lengths - 1]  # [B, D]
        scores.extend(model.head(last.float()).squeeze(-1).tolist())
    return scores
