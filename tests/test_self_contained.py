"""The repository stands on its own: its data (with licence), its documents, and no machine paths anywhere.

A user's clone has nothing beside it: every file the code, the tests, the scripts and the README name lives in
the tree, and no tracked text names an absolute path of the machines the project was built on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from repo_data import REPO

TEXT_SUFFIXES = {".py", ".sh", ".md", ".toml", ".json", ".jsonl", ".txt", ".yaml", ".yml", ".cfg", ""}
SKIP_DIRS = {".git", ".venv", ".ci-venv", "__pycache__", ".pytest_cache", "build", "dist", ".whl", ".cache",
             ".ruff_cache"}
# spelled in pieces so that this file does not match itself
MACHINE_PATHS = re.compile("|".join(re.escape(p) for p in ("/" + "work/", ".." + "/shared", "/opt" + "/torch",
                                                              "/root" + "/", "/" + "home/")))


def _text_files() -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        rel = path.relative_to(REPO).parts
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel[:-1]) or not path.is_file():
            continue
        if path.suffix in TEXT_SUFFIXES and path.name != ".git":
            files.append(path)
    return files


def test_no_file_names_a_machine_path():
    offenders = []
    for path in _text_files():
        for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if MACHINE_PATHS.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_jevbench_ships_with_its_licence_and_attribution():
    for folder in ("data/jevbench", "data/jevbench-sample"):
        licence = (REPO / folder / "LICENSE.txt").read_text(encoding="utf-8")
        assert licence.startswith("MIT License") and "Florian Standhartinger and contributors" in licence
        readme = (REPO / folder / "README.md").read_text(encoding="utf-8")
        assert "Attribution" in readme and "Florian Standhartinger" in readme and "LICENSE.txt" in readme
    counts = {}
    for tier in ("easy", "original", "hard"):
        lines = (REPO / "data/jevbench" / f"{tier}.jsonl").read_text(encoding="utf-8").splitlines()
        counts[tier] = len([json.loads(line) for line in lines if line.strip()])
    assert counts == {"easy": 48, "original": 72, "hard": 111}
    assert (REPO / "data/jevbench-sample/easy.jsonl").read_bytes() == (REPO / "data/jevbench/easy.jsonl").read_bytes()


def _cited_docs() -> dict[str, set[str]]:
    """``docs/<name>.md`` -> the files that cite it (the code, the tests, the scripts, the README)."""
    cited: dict[str, set[str]] = {}
    for path in _text_files():
        if path.suffix not in (".py", ".sh") and path.name != "README.md":
            continue
        for name in re.findall(r"docs/[a-z_]+\.md", path.read_text(encoding="utf-8", errors="replace")):
            cited.setdefault(name, set()).add(str(path.relative_to(REPO)))
    return cited


def test_every_cited_document_is_in_the_repository():
    cited = _cited_docs()
    assert {"docs/contract.md", "docs/checkpoints.md", "docs/design.md", "docs/performance.md"} <= set(cited)
    missing = {name: sorted(files) for name, files in cited.items() if not (REPO / name).is_file()}
    assert not missing, missing


def test_every_cited_contract_section_exists():
    headings = set(re.findall(r"^## (\d+)\. ", (REPO / "docs/contract.md").read_text(encoding="utf-8"), re.M))
    cited = set()
    for path in _text_files():
        if path.suffix == ".py":
            cited |= set(re.findall(r"docs/contract\.md §(\d+)", path.read_text(encoding="utf-8")))
    assert cited and cited <= headings, sorted(cited - headings)


def test_the_readme_names_files_that_exist():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    named = set(re.findall(r"(?<![\w/])((?:data|recipes|docs)/[\w./-]+\.(?:jsonl|json|md))", readme))
    assert "data/jevbench/original.jsonl" in named
    assert not [name for name in named if not (REPO / name).is_file()]


def test_every_cited_section_name_exists():
    """``docs/design.md "Numerics"``: a heading of that document starts with the quoted name."""
    cited: dict[str, set[str]] = {}
    for path in _text_files():
        if path.suffix in (".py", ".sh"):
            for name, section in re.findall(r'(docs/[a-z_]+\.md),? "([^"]+)"', path.read_text(encoding="utf-8")):
                cited.setdefault(name, set()).add(section)
    assert cited.get("docs/design.md", set()) >= {"Numerics", "Layout"}
    for name, sections in cited.items():
        headings = re.findall(r"^#+ (.+)$", (REPO / name).read_text(encoding="utf-8"), re.M)
        assert all(any(h.startswith(s) for h in headings) for s in sections), (name, sections, headings)


def _user_documents() -> list[Path]:
    return [REPO / "README.md", REPO / "CONTRIBUTING.md", *sorted((REPO / "docs").glob("*.md"))]


def test_every_relative_link_in_the_user_documents_resolves():
    broken = []
    for path in _user_documents():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_every_section_the_user_documents_cite_by_name_exists():
    """``[docs/usage.md](docs/usage.md) "On a CPU"``, ``checkpoints.md "Getting a checkpoint"``: a heading of that
    document starts with the quoted name."""
    documents = {p.name: p for p in (REPO / "docs").glob("*.md")}
    cited = set()
    for path in _user_documents():
        for name, section in re.findall(r'([a-z_]+\.md)\)?,?\s+"([^"]+)"', path.read_text(encoding="utf-8")):
            if name in documents:
                cited.add((name, " ".join(section.split())))
    assert ("checkpoints.md", "Getting a checkpoint") in cited and ("usage.md", "On a CPU") in cited
    missing = []
    for name, section in sorted(cited):
        headings = re.findall(r"^#+ (.+)$", documents[name].read_text(encoding="utf-8"), re.M)
        if not any(h.startswith(section) for h in headings):
            missing.append((name, section))
    assert not missing, missing


def _documented_commands() -> list[list[str]]:
    """Every ``hf-openjev ...`` command in a bash block of the README and docs/ (continuations joined), as argv."""
    import shlex

    commands = []
    for path in _user_documents():
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(encoding="utf-8"), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                for part in line.split("&&"):
                    part = part.split(" #")[0].strip()
                    if part.startswith("hf-openjev ") and " ... " not in part:
                        commands.append(shlex.split(part)[1:])
    return commands


def test_every_documented_command_parses():
    """The options and choices of each documented command are its parser's (an unknown option exits)."""
    from hf_openjev.cli import build_parser

    commands = _documented_commands()
    assert {argv[0] for argv in commands} >= {"demo", "export", "eval", "serve", "fidelity", "quantize"}
    for argv in commands:
        args = build_parser(argv[0]).parse_args(argv)
        assert args.command == argv[0]
