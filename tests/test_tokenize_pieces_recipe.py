"""recipes/tokenize_pieces.py, small: both arms run, give the same ids (checked inside), the piece size restored."""

import json

from repo_data import load_recipe


def test_pieces_and_whole_texts_are_timed_and_the_piece_size_restored(capsys):
    from hf_openjev.tokenizer import candidate_tokens

    size = candidate_tokens.PIECE_CHARS
    assert load_recipe("tokenize_pieces").main(["--words", "3000", "--rounds", "1", "--calls", "1"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert candidate_tokens.PIECE_CHARS == size and result["state_chars"] > 2 * size
    assert set(result["median_ms"]) == {"pieces, choice of 6", "pieces, noul", "whole, choice of 6", "whole, noul"}
