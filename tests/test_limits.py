"""What one request may cost (hf_openjev.serve.limits): the group deadline derived from the request timeout (issue 36
item 9), so that a hung replica's group is retried before its requests time out; options checked when built."""

from __future__ import annotations

import pytest

from hf_openjev.errors import UsageError
from hf_openjev.serve.limits import UNTIMED_GROUP_DEADLINE_S, RequestLimits


def test_with_replicas_the_group_deadline_is_a_quarter_of_the_request_timeout_unless_set():
    assert RequestLimits(request_timeout_s=2.0).group_deadline(replicas=2) == 0.5
    assert RequestLimits().group_deadline(replicas=4) < RequestLimits().request_timeout_s / 2
    # nobody to retry it on: past the request timeout, so that its requests get their own 504 first
    assert RequestLimits(request_timeout_s=2.0).group_deadline(replicas=1) == pytest.approx(2.2)
    assert RequestLimits(request_timeout_s=600.0).group_deadline(replicas=1) == 601.0
    assert RequestLimits(request_timeout_s=2.0, group_deadline_s=1.5).group_deadline(replicas=2) == 1.5
    assert RequestLimits(request_timeout_s=None).group_deadline(replicas=2) == UNTIMED_GROUP_DEADLINE_S


@pytest.mark.parametrize("field, value, option", [("slice_tokens", 0, "--slice-tokens"),
                                                  ("slice_tokens", 1.5, "--slice-tokens"),
                                                  ("group_deadline_s", -1.0, "--group-deadline")])
def test_bad_slice_and_deadline_values_are_refused_naming_their_option(field, value, option):
    with pytest.raises(UsageError, match=option):
        RequestLimits(**{field: value})


def test_serve_passes_slice_tokens_and_group_deadline_in_its_limits(monkeypatch):
    from serve_cli_args import serve_parser

    from hf_openjev.serve import cli as serve_cli
    from hf_openjev.serve import startup

    seen = {}
    monkeypatch.setattr(startup, "serve", lambda model_dir, **kw: seen.update(kw) or 0)
    args = serve_parser().parse_args(["--model", "/x", "--slice-tokens", "512", "--group-deadline", "3",
                                      "--request-timeout", "20"])
    assert serve_cli.run(args) == 0
    limits = seen["limits"]
    assert limits.slice_tokens == 512 and limits.group_deadline(replicas=2) == 3.0
    serve_cli.run(serve_parser().parse_args(["--model", "/x", "--request-timeout", "20"]))
    assert seen["limits"].slice_tokens is None and seen["limits"].group_deadline(replicas=2) == 5.0
