"""recipes/cpu_request.py on the tiny shape: one request timed twice, its CPU time and the peak memory reported."""

import json

import pytest
from repo_data import load_recipe


@pytest.mark.slow
def test_one_request_is_timed_twice_with_its_cpu_time_and_peak_memory(capsys):
    recipe = load_recipe("cpu_request")
    assert recipe.main(["--shape", "tiny", "--dtype", "float32"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (result["shape"], result["dtype"]) == ("tiny", "float32")
    assert result["input_tokens"] > 0  # the README's example request, through the real tokenizer and chat halves
    for key in ("first_request_s", "second_request_s", "first_request_cpu_s", "second_request_cpu_s"):
        assert result[key] > 0, key
    assert result["peak_rss_gb"] >= result["peak_rss_after_build_gb"] > 0
