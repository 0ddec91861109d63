"""``cachemgr completion bash|zsh``: a completion script generated from the parser itself.

shtab writes it from the argparse parser, so every command, option and choice completes as the
parser has them today (whoever added them); it is imported here only, and nothing else pays for
it. Directories complete where an option takes one.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from cachemgr.cli.main import build_parser

_DIRECTORY_OPTIONS = {"--cache-root", "--state-dir", "--dir"}


def completion(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    import shtab  # the completion command only

    parser = build_parser()
    for action in _actions(parser):
        if _DIRECTORY_OPTIONS.intersection(action.option_strings):
            action.complete = shtab.DIRECTORY  # type: ignore[attr-defined]  # shtab reads this attribute
    sys.stdout.write(shtab.complete(parser, shell=args.shell))
    return 0


def _actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    found = list(parser._actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _actions(sub)
    return found
