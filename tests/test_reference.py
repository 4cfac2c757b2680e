"""hf_openjev.reference: right-padded batches, last real token, fp32 head; the oracle of every fast path."""

from __future__ import annotations

import pytest
import torch
from conftest import independent_score

from hf_openjev import load_export
from hf_openjev.reference import DEFAULT_BATCH_SIZE, score_reference

# odd lengths, a length-1 sequence, lengths on both sides of the 64-token GDN chunk
LENGTHS = [1, 3, 7, 17, 33, 63, 65, 70, 5, 129, 2, 11, 64, 31]


def _random_sequences(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    seqs[3][2] = 0  # the pad id inside a real sequence is a real token, not padding
    return seqs


@pytest.fixture(scope="module")
def sequences(tiny_model):
    return _random_sequences(len(tiny_model.tokenizer), LENGTHS)


@pytest.fixture(scope="module")
def alone(tiny_model, sequences):
    return [independent_score(tiny_model, s) for s in sequences]


def _close(a, b, tol):
    assert len(a) == len(b)
    worst = max(abs(x - y) for x, y in zip(a, b))
    assert worst < tol, worst


def test_default_batch_size_is_32():
    assert DEFAULT_BATCH_SIZE == 32


def test_batch_scores_equal_each_sequence_alone(tiny_model, sequences, alone):
    assert len({round(s, 4) for s in alone}) == len(alone), "scores must differ between sequences"
    one = score_reference(tiny_model, sequences, batch_size=1)
    full = score_reference(tiny_model, sequences)  # default: one batch of 14
    three = score_reference(tiny_model, sequences, batch_size=3)
    assert all(isinstance(s, float) for s in full)
    _close(one, alone, 1e-5)
    _close(full, alone, 1e-5)
    _close(three, alone, 1e-5)


def test_order_and_companions_do_not_matter(tiny_model, sequences, alone):
    reversed_scores = score_reference(tiny_model, sequences[::-1], batch_size=5)
    _close(reversed_scores[::-1], alone, 1e-5)
    # the longest sequence padded against short ones, and a short one padded to the longest
    pair = score_reference(tiny_model, [sequences[0], sequences[9]])
    _close(pair, [alone[0], alone[9]], 1e-5)


def test_batches_are_right_padded_with_a_mask(tiny_model, sequences):
    calls = []

    def record(_module, _args, kwargs):
        calls.append((kwargs["input_ids"].clone(), kwargs["attention_mask"].clone()))

    seqs = sequences * 5  # 70 sequences -> batches of 32, 32, 6
    handle = tiny_model.backbone.register_forward_pre_hook(record, with_kwargs=True)
    try:
        score_reference(tiny_model, seqs)
    finally:
        handle.remove()
    assert [ids.shape[0] for ids, _ in calls] == [32, 32, 6]
    start = 0
    for ids, mask in calls:
        batch = seqs[start:start + ids.shape[0]]
        start += ids.shape[0]
        assert ids.shape[1] == max(len(s) for s in batch)  # padded to the longest of the batch only
        for row, seq in enumerate(batch):
            assert ids[row, : len(seq)].tolist() == seq
            assert mask[row].tolist() == [1] * len(seq) + [0] * (ids.shape[1] - len(seq))
            assert ids[row, len(seq):].eq(0).all()


def test_head_reads_fp32_final_norm_state_of_a_bf16_backbone(tiny_checkpoint, sequences):
    model = load_export(tiny_checkpoint.export, dtype="bfloat16", device="cpu")
    seen = []
    handle = model.head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        scores = score_reference(model, sequences[:4], batch_size=1)
    finally:
        handle.remove()
    assert [t.dtype for t in seen] == [torch.float32] * 4
    assert [tuple(t.shape) for t in seen] == [(1, 64)] * 4
    assert model.head.weight.dtype == torch.float32
    expected = [independent_score(model, s) for s in sequences[:4]]
    _close(scores, expected, 1e-4)


def test_empty_input_and_bad_batch_size(tiny_model, sequences):
    assert score_reference(tiny_model, []) == []
    with pytest.raises(ValueError, match="batch_size must be at least 1"):
        score_reference(tiny_model, sequences, batch_size=0)


def _forward_shapes(model):
    """Record the ``[B, W]`` shape of every backbone forward; returns (shapes, the hook's handle)."""
    shapes = []
    handle = model.backbone.register_forward_hook(
        lambda _m, _a, kwargs, _o: shapes.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True)
    return shapes, handle


def test_a_forward_holds_at_most_max_batch_tokens_padded(tiny_model, sequences, alone):
    shapes, handle = _forward_shapes(tiny_model)
    try:
        bounded = score_reference(tiny_model, sequences, max_batch_tokens=200)
    finally:
        handle.remove()
    assert len(shapes) > 1 and sum(b for b, _ in shapes) == len(sequences)
    assert all(b * w <= 200 or b == 1 for b, w in shapes), shapes  # the 129-token one: alone, whatever its company
    _close(bounded, alone, 1e-5)


def test_the_default_bound_splits_what_batch_size_alone_would_pad_together(tiny_model):
    from hf_openjev.work_tokens import DEFAULT_BATCH_TOKENS

    width = DEFAULT_BATCH_TOKENS // 8 + 1  # 8 of them pad past the default bound; 32 fit the default batch size
    seqs = _random_sequences(len(tiny_model.tokenizer), [width] * 9, seed=1)
    shapes, handle = _forward_shapes(tiny_model)
    try:
        score_reference(tiny_model, seqs)
    finally:
        handle.remove()
    assert shapes == [(7, width), (2, width)]


def test_a_bad_max_batch_tokens(tiny_model, sequences):
    with pytest.raises(ValueError, match="max_batch_tokens must be a positive integer"):
        score_reference(tiny_model, sequences, max_batch_tokens=0)
