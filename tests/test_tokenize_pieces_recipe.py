"""recipes/tokenize_pieces.py, small: every arm runs and each pair gives the same ids (checked inside); the piece size
and the batch size restored."""

import json

import pytest
from repo_data import load_recipe


@pytest.mark.slow
def test_pieces_and_whole_texts_are_timed_and_the_piece_size_restored(capsys):
    from hf_openjev.tokenizer import candidate_tokens

    size, batch = candidate_tokens.PIECE_CHARS, candidate_tokens.BATCH_BYTES
    assert load_recipe("tokenize_pieces").main(["--words", "3000", "--rounds", "1", "--calls", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert candidate_tokens.PIECE_CHARS == size and result["state_chars"] > 2 * size
    assert candidate_tokens.BATCH_BYTES == batch == result["batch_bytes"] > 0
    short = {f"{arm}, {group}" for arm in ("together", "one by one")
             for group in ("noul 1-128", "choice 1-512", "all <= 512")}
    assert set(result["median_ms"]) == {"pieces, choice of 6", "pieces, noul", "whole, choice of 6",
                                        "whole, noul"} | short
