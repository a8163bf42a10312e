"""Every command and every flag of ``kuberl`` says what it is for (issue 67: help text for every CLI flag),
and the README's commands block names every command."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

from kuberl_cli.main import build_parser

from .conftest import ROOT


def commands_and_arguments(parser: argparse.ArgumentParser, path: str = "kuberl"
                           ) -> Iterator[tuple[str, str, str | None]]:
    """(command, argument, its help) for every subcommand (its help as argument "") and argument."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, sub in action.choices.items():
                yield f"{path} {name}", "", helps.get(name)
                yield from commands_and_arguments(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, "/".join(action.option_strings) or action.dest, action.help


def test_every_command_and_flag_has_help():
    bare = [(command, argument) for command, argument, text in commands_and_arguments(build_parser()) if not text]
    assert bare == []


def test_the_readme_lists_every_command():
    readme = (ROOT / "README.md").read_text()
    commands = {command for command, argument, _ in commands_and_arguments(build_parser()) if argument == ""}
    assert len(commands) >= 9 and [c for c in sorted(commands) if f"\n{c} " not in readme] == []
