"""``cachemgr completion bash|zsh|fish``: a completion script generated from the parser itself,
and ``completion --keys PREFIX``, which the scripts call to complete a KEY.

shtab writes the script from the argparse parser, so every command, option and choice completes as
the parser has them today (whoever added them); it is imported here only, and nothing else pays for
it. Directories complete where an option takes one; a KEY (``show``, ``verify``, ``prune --key``,
``push``) completes to the keys and entry names of the volume in ``CACHEMGR_CACHE_ROOT``; ``-o``
to the output forms that command has (``json``, ``wide``, ``jsonpath=``...), with no space after a
form whose text follows its ``=``.

That listing is made for a shell waiting on a keystroke, from what anyone can write: it reads the
directory listings of ``entries/``, ``staging/`` and ``failures/`` and nothing inside them (no
summary, no record: 10,000 entries are one directory read); it prints only names a shell takes as
one plain word (letters, digits, ``.``, ``_``, ``+``, ``-``; anything else is left out, never
quoted or escaped into a command line); at most ``LIMIT`` of them; and it never fails: no volume,
an unreadable one, a planted link, all print nothing.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Mapping
from typing import Any

from cachemgr.cli.options import OutputForm
from cachemgr.core.errors import UsageError

LIMIT = 500  # candidates at most: a shell shows them all, and more is no help to a person
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]{0,252}")
_DIRECTORY_OPTIONS = {"--cache-root", "--state-dir", "--dir"}
# (command, dest) of the arguments that name a KEY of the local volume.
_KEY_ARGUMENTS = {("show", "key"), ("verify", "keys"), ("push", "keys"), ("prune", "key")}
_KEYS = {
    # bash calls the function with the word being completed and takes its lines as they are.
    "bash": "_cachemgr_keys",
    # zsh's _arguments takes "(word word ...)" and matches the word itself.
    "zsh": '(${(f)"$(cachemgr completion --keys 2>/dev/null)"})',
    "fish": "(cachemgr completion --keys (commandline -ct) 2>/dev/null)",
}
_PREAMBLE = {"bash": '_cachemgr_keys() {\n  cachemgr completion --keys "$1" 2>/dev/null\n}'}


def completion(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    if args.keys is not None:
        for name in keys(environ.get("CACHEMGR_CACHE_ROOT") or "", args.keys):
            sys.stdout.write(name + "\n")
        return 0
    if args.shell is None:
        raise UsageError(
            "name the shell to complete in: bash, zsh or fish",
            remedy="e.g. source <(cachemgr completion bash)",
        )
    import shtab  # the completion command only

    parser, forms = _parser_with_completers(shtab.DIRECTORY)
    preamble = "\n".join([_PREAMBLE.get(args.shell, ""), *_forms_functions(args.shell, forms)]).strip()
    sys.stdout.write(shtab.complete(parser, shell=args.shell, preamble=preamble))
    sys.stdout.write(_NO_SPACE_AFTER_EQUALS.get(args.shell, ""))
    return 0


def _parser_with_completers(directory: Any) -> tuple[argparse.ArgumentParser, list[list[str]]]:
    """The parser with what shtab completes for each action, and the sets of ``-o`` forms."""
    from cachemgr.cli.main import build_parser

    parser = build_parser()
    forms: list[list[str]] = []
    for command, action in _actions(parser, ""):
        if _DIRECTORY_OPTIONS.intersection(action.option_strings):
            action.complete = directory  # type: ignore[attr-defined]  # shtab reads this attribute
        elif (command, action.dest) in _KEY_ARGUMENTS:
            action.complete = _KEYS  # type: ignore[attr-defined]
        elif isinstance(action.type, OutputForm):
            candidates = action.type.candidates()
            if candidates not in forms:
                forms.append(candidates)
            action.complete = _forms_action(forms.index(candidates), candidates)  # type: ignore[attr-defined]
    return parser, forms


def _forms_action(number: int, candidates: list[str]) -> dict[str, str]:
    """What each shell runs to complete ``-o``: bash a function of the preamble (it takes the
    word), zsh's ``_arguments`` an action that adds a form taking text (``jsonpath=``) with no
    space after it, fish a word list."""
    texts = " ".join(c for c in candidates if c.endswith("="))
    plain = " ".join(c for c in candidates if not c.endswith("="))
    return {
        "bash": f"_cachemgr_output_forms_{number}",
        "zsh": f"{{compadd -- {plain}; compadd -S '' -- {texts}}}",
        "fish": " ".join(candidates),
    }


def _forms_functions(shell: str, forms: list[list[str]]) -> list[str]:
    """bash: one function per set of ``-o`` forms, called with the word being completed."""
    if shell != "bash":
        return []
    return [
        f'_cachemgr_output_forms_{number}() {{\n  compgen -W "{" ".join(candidates)}" -- "$1"\n}}'
        for number, candidates in enumerate(forms)
    ]


# bash adds a space after the one candidate it completes: none after "jsonpath=", whose template
# follows. shtab's function fills COMPREPLY (a function run in a subshell cannot say this).
_NO_SPACE_AFTER_EQUALS = {
    "bash": """
_cachemgr_complete() {
  _shtab_cachemgr "$@"
  if [[ ${#COMPREPLY[@]} -eq 1 && ${COMPREPLY[0]} == *= ]]; then
    compopt -o nospace 2>/dev/null || :
  fi
}
complete -o bashdefault -F _cachemgr_complete cachemgr
"""
}


def _actions(parser: argparse.ArgumentParser, command: str) -> Iterator[tuple[str, argparse.Action]]:
    for action in parser._actions:
        yield command, action
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, name)


def keys(root: str, prefix: str) -> list[str]:
    """The short keys (12 digits) and entry names under ``root`` starting with ``prefix``, sorted,
    at most ``LIMIT``; nothing when the volume cannot be read."""
    from pathlib import Path

    from cachemgr.core import safefs  # the listing only, not the script
    from cachemgr.volume.layout import CacheRoot

    if not root:
        return []
    try:
        cache = CacheRoot(Path(root))
        names = safefs.listdir(cache.path, cache.entries)
        digests = [*safefs.listdir(cache.path, cache.staging), *safefs.listdir(cache.path, cache.failures)]
    except (OSError, ValueError, safefs.UnsafePathError):
        return []
    found = {name for name in names if _PLAIN.fullmatch(name)}
    found |= {name.rsplit("__", 1)[-1][:12] for name in found if "__" in name}
    found |= {d[:12] for d in digests if re.fullmatch(r"[0-9a-f]{16,32}", d)}
    return sorted(n for n in found if n.startswith(prefix) and len(n) >= 12)[:LIMIT]
