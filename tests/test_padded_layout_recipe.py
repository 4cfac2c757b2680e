"""recipes/padded_layout_check.py on the CPU, its fla kernel stood in for by the plain-torch GDN reference (which
takes zero-length sequences and ignores chunk_indices): the padding it builds is consistent, and a kernel that lets
the padding leak into real rows is caught."""

import json

from repo_data import load_recipe

from hf_openjev.ops import gdn_prefill


def _reference_kernel(q, k, v, g, beta, scale, h0, output_final_state, cu, indices, offsets):
    """fla_chunk_forward's signature ([1, T, H, D] in), computed by gdn_prefill_reference."""
    o, final = gdn_prefill.gdn_prefill_reference(q[0], k[0], v[0], g[0], beta[0], cu, h0)
    return o[None], final


def test_a_padded_layout_gives_the_plain_rows_with_the_reference(monkeypatch, tmp_path):
    recipe = load_recipe("padded_layout_check")
    monkeypatch.setattr(gdn_prefill, "fla_chunk_forward", _reference_kernel)
    result = recipe.check_gdn(device="cpu", lengths=[70, 1, 130], pad_rows=9, pad_sequences=2, dummy_chunks=3)
    assert result["rows_max_diff"] == 0.0 and result["states_max_diff"] == 0.0
    assert result["padded_states_keep_their_initial"] is True and result["padding_rows_finite"] is True
    layout = recipe.varlen_layout([70, 1, 0], "cpu")
    assert layout.chunk_indices.tolist() == [[0, 0], [0, 1], [1, 0]] and layout.chunk_offsets.tolist() == [0, 2, 3, 3]
    assert layout.cu_seqlens.tolist() == [0, 70, 71, 71]
    assert recipe.main(["--out", str(tmp_path)]) == 0  # the CPU: the GDN part alone
    assert set(json.loads((tmp_path / "padded_layout.json").read_text())) == {"device", "gdn"}


def test_a_kernel_that_reads_the_padding_is_caught(monkeypatch, tmp_path):
    recipe = load_recipe("padded_layout_check")

    def leaky(q, k, v, g, beta, scale, h0, output_final_state, cu, indices, offsets):
        o, final = _reference_kernel(q, k, v, g, beta, scale, h0, output_final_state, cu, indices, offsets)
        return o + v.mean(dim=1, keepdim=True) * 1e-3, final  # every row sees every row, padding included

    monkeypatch.setattr(gdn_prefill, "fla_chunk_forward", leaky)
    assert recipe.check_gdn(device="cpu", lengths=[70, 1], pad_rows=5, pad_sequences=1, dummy_chunks=1)[
        "rows_max_diff"] > 0
    assert recipe.main(["--out", str(tmp_path)]) == 1
