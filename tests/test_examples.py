"""Every ``symmem`` command the README, a ``--help`` text or the CLI's docstring shows runs and
exits 0. The commands are read from those texts (not copied here), so an example that stops
working fails this test.

Shell syntax is read as a user's shell would: ``\\`` continues a line, ``# ...`` is a comment,
``> FILE`` sends standard output to a file (captured here instead), ``&& ...`` runs another
program afterwards (not run here). ``-o FILE`` is redirected into a temporary folder, so that
nothing is written into the repository.
"""
import shlex
from pathlib import Path

import pytest

import symmem.cli
from symmem.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _commands(text: str) -> list[str]:
    lines = text.replace("\\\n", " ").splitlines()
    return [" ".join(line.split()) for line in lines if line.strip().startswith("symmem ")]


def _readme_commands() -> list[str]:
    """The symmem lines of the README's shell blocks (fenced blocks without a language)."""
    out, language = [], None          # language: None outside a fenced block
    block: list[str] = []
    for line in (ROOT / "README.md").read_text().splitlines():
        if line.startswith("```"):
            if language is None:
                language, block = line.strip()[3:], []
            else:
                if language == "":
                    out += _commands("\n".join(block))
                language = None
            continue
        if language is not None:
            block.append(line)
    return out


def _help_commands() -> list[str]:
    parser = build_parser()
    texts = [parser.format_help()]
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    texts += [p.format_help() for p in sub.choices.values()]
    return [c for t in texts for c in _commands(t)]


COMMANDS = list(dict.fromkeys(_readme_commands() + _help_commands() + _commands(symmem.cli.__doc__)))


def test_the_texts_show_commands():
    # the README's shell block and the examples of every subcommand that has them
    assert len(_readme_commands()) >= 10
    for cmd in ("estimate", "max-batch", "solve", "sweep", "report", "formula", "models", "gpus", "policies"):
        assert any(c.startswith(f"symmem {cmd}") for c in COMMANDS), cmd


@pytest.mark.parametrize("command", COMMANDS)
def test_example_runs(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)                       # examples name examples/... relative to the root
    line = command.split(" #")[0].split(" && ")[0]
    line, _, redirect = line.partition(" > ")
    argv = shlex.split(line)[1:]
    if "-o" in argv:
        argv[argv.index("-o") + 1] = str(tmp_path / Path(argv[argv.index("-o") + 1]).name)
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, (command, err)
    assert "Traceback" not in err
    assert out or "-o" in argv                    # something was printed, or written to -o
