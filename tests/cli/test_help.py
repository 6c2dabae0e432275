"""`--help` shows every help text as we wrote it: typer reads help as Rich markup, where a bracketed fragment such as
`[ids]` or `[default: 256]` would be taken for a style tag and vanish."""

from __future__ import annotations

import re

import pytest

from cbgen.cli import COMMANDS as LISTED
from cbgen.cli import load_command, run_cli

COMMANDS = [["run"], ["status"], ["merge"], ["bench"], ["config", "show"], ["config", "init"]]


def source_texts(path: list[str]) -> list[str]:
    """The command's help and its parameters' help texts, as written in the source (before any escaping)."""
    command = load_command(path[0], literal=False)
    for name in path[1:]:
        command = command.commands[name]
    return [command.help or ""] + [getattr(p, "help", None) or "" for p in command.params]


def flat(text: str) -> str:
    """Help output without box drawing and line breaks, so a fragment is found wherever the panel wrapped it."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())


@pytest.mark.parametrize("path", COMMANDS, ids=" ".join)
def test_bracketed_fragments_survive(path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv("TERMINAL_WIDTH", "400")
    assert run_cli([*path, "--help"]) == 0
    shown = flat(capsys.readouterr().out)
    fragments = [f for text in source_texts(path) for f in re.findall(r"\[[^\]\[]+\]", text)]
    missing = [f for f in fragments if flat(f) not in shown]
    assert not missing, f"vanished from `cbgen {' '.join(path)} --help`: {missing}"


def test_the_fragments_the_markup_used_to_eat_are_there(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    monkeypatch.setenv("TERMINAL_WIDTH", "400")
    run_cli(["merge", "--help"])
    assert '"missing": {shard: [ids]}' in flat(capsys.readouterr().out)
    run_cli(["run", "--help"])
    shown = flat(capsys.readouterr().out)
    assert "[default: 256]" in shown and "a pair [prefill path, decode path]" in shown
    assert "Examples" in shown and "[bold]" not in shown  # the epilog's own markup still styles it


def test_the_command_list_says_what_each_command_does():
    """`cbgen --help` lists the commands from a table, so that it imports none of them: each line is the first
    paragraph of the command's own help."""
    for name, (_, _, line) in LISTED.items():
        written = " ".join((load_command(name, literal=False).help or "").split("\n\n")[0].split())
        assert line == written, f"cbgen --help says of {name!r}: {line!r}; its help: {written!r}"


def test_the_command_list_imports_no_command(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from cbgen.cli import run_cli; run_cli(['--help']); "
            "sys.exit(any(m.startswith('cbgen.cli.') and m != 'cbgen.cli' for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and "run       Generate an answer" in done.stdout
