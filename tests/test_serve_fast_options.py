"""`hf-openjev serve --fast-options JSON`: the fast path's options for every request and the warm-up, checked
before anything loads (a bad JSON, name or value, fp8 given there, options with --reference: one line, exit 2),
and reaching the app that serves."""

import logging

import pytest
from serve_cli_args import forbid_loading, serve_parser

from hf_openjev.fast_options import FastPathOptions
from hf_openjev.serve import cli as serve_cli


@pytest.mark.parametrize("value, message", [
    ("{dense: 1}", "not JSON"),
    ("[1]", "give a JSON object of option names"),
    ('{"dense_attention": 1}', "unknown fast-path option(s): dense_attention"),
    ('{"packed_candidates": "no"}', "packed_candidates must be True or False"),
    ('{"max_sequences": 0}', "max_sequences must be a positive integer"),
])
def test_a_bad_value_is_refused_by_the_command_line_in_one_line(value, message, capsys):
    with pytest.raises(SystemExit) as info:
        serve_parser().parse_args(["--model", "/x", "--fast-options", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and "argument --fast-options" in err and message in err, err


@pytest.mark.parametrize("extra, message", [
    (["--fast-options", '{"fp8": "all"}'], "--fast-options: fp8 has its own option: --fp8 MODE"),
    (["--fast-options", '{"cuda_graphs": false}', "--reference"],
     "--fast-options are the fast path's options but --reference asks for the reference path"),
])
def test_fp8_there_or_options_with_the_reference_path_are_refused_before_loading(extra, message, tmp_path,
                                                                                 monkeypatch, capsys):
    forbid_loading(monkeypatch, "--fast-options check")
    args = serve_parser().parse_args(["--model", str(tmp_path / "no-export"), "--port", "0", *extra])
    assert serve_cli.run(args) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-openjev serve: error: ") and message in err and "\n" not in err


def test_the_options_reach_the_app_that_serves(tiny_checkpoint, monkeypatch, caplog):
    """On the tiny checkpoint on the CPU (whose default is the reference path): the options select the fast path, the
    app is built with the defaults changed as given, and the start-up log names them."""
    import uvicorn
    from live_server import run_lifespan_without_a_socket

    from hf_openjev.serve import startup

    built = []
    create_app = startup.create_app
    monkeypatch.setattr(startup, "create_app",
                        lambda model, **kw: built.append((kw["fast"], kw["options"])) or create_app(model, **kw))
    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan_without_a_socket)
    args = serve_parser().parse_args(["--model", str(tiny_checkpoint.export), "--device", "cpu", "--port", "0",
                                      "--fast-options", '{"min_shared_tokens": 7, "share_tails": false}'])
    with caplog.at_level(logging.INFO, logger="hf_openjev.serve.server"):
        assert serve_cli.run(args) == 0
    assert built == [(True, FastPathOptions(min_shared_tokens=7, share_tails=False))]
    assert ("fast-path options other than the package defaults (the model's own or given): "
            '{"min_shared_tokens": 7, "share_tails": false}') in caplog.text


def test_a_members_own_defaults_reach_the_app_under_the_options_given(tiny_checkpoint, monkeypatch, caplog):
    """A shape with defaults of its own (the 2B's; here the tiny shape registered as a member): the app is built
    with them, and ``--fast-options`` changes only what it names."""
    import json

    import uvicorn
    from live_server import run_lifespan_without_a_socket

    from hf_openjev import family
    from hf_openjev.fast_options import MEMBER_DEFAULTS
    from hf_openjev.serve import startup

    config = json.loads((tiny_checkpoint.export / "config.json").read_text())
    shape = family.shape_of(type("Config", (), config.get("text_config", config)))
    member = family.FamilyMember("Open-Jev-Tiny", "none/tiny", shape, 1.0, tied=False)
    monkeypatch.setattr(family, "MEMBERS", (*family.MEMBERS, member))
    monkeypatch.setitem(MEMBER_DEFAULTS, member.name, {"packed_candidates": False, "shared_prefix": False})
    built = []
    create_app = startup.create_app
    monkeypatch.setattr(startup, "create_app",
                        lambda model, **kw: built.append((kw["fast"], kw["options"])) or create_app(model, **kw))
    monkeypatch.setattr(uvicorn.Server, "run", run_lifespan_without_a_socket)
    for extra in ([], ["--fast-options", '{"cuda_graphs": false}']):
        args = serve_parser().parse_args(["--model", str(tiny_checkpoint.export), "--device", "cpu", "--port", "0",
                                          *extra])
        with caplog.at_level(logging.INFO, logger="hf_openjev.serve.server"):
            assert serve_cli.run(args) == 0
    own = FastPathOptions(packed_candidates=False, shared_prefix=False)
    assert built == [(None, own), (True, own.replace(cuda_graphs=False))]
    assert '{"cuda_graphs": false, "packed_candidates": false, "shared_prefix": false}' in caplog.text
