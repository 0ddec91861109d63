"""``cachemgr``: parse, call the library, render. Nothing else lives here.

Each command's handler is imported only when that command runs: ``cachemgr probe`` runs in
every pod every few seconds and must not pay for the libraries ``run`` needs. The help of
every command opens with what it is for and ends with examples; every option has a help text,
durations are one form everywhere (``90``, ``90s``, ``15m``, ``1h30m``: a plain number is
seconds) and sizes another (``150Gi``, ``512Mi``, bytes). ``tests/test_help.py`` holds every
command and option to that, whoever adds them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence

from cachemgr import __version__
from cachemgr.cli.commands import COMMANDS as _COMMANDS
from cachemgr.cli.options import FORMATTER, POD_COMMANDS, Parser
from cachemgr.core.errors import ExitCode, UsageError

# command -> (handler "module:function", entrypoint?): entrypoints write the termination message.
_HANDLERS: dict[str, tuple[str, bool]] = {
    "run": ("cachemgr.cli.cmd_run:run", True),
    "warm": ("cachemgr.cli.cmd_run:warm", True),
    "key": ("cachemgr.cli.cmd_run:key", False),
    "demo": ("cachemgr.cli.cmd_run:demo", False),
    "explain": ("cachemgr.cli.cmd_inspect:explain", False),
    "ls": ("cachemgr.cli.cmd_inspect:ls", False),
    "show": ("cachemgr.cli.cmd_show:show", False),
    "du": ("cachemgr.cli.cmd_maintain:du", False),
    "verify": ("cachemgr.cli.cmd_maintain:verify", False),
    "prune": ("cachemgr.cli.cmd_maintain:prune", False),
    "locks": ("cachemgr.cli.cmd_inspect:locks", False),
    "stats": ("cachemgr.cli.cmd_stats:stats", False),
    "probe": ("cachemgr.cli.cmd_probe:probe", False),
    "push": ("cachemgr.cli.cmd_remote:push", False),
    "pull": ("cachemgr.cli.cmd_remote:pull", False),
    "completion": ("cachemgr.cli.cmd_completion:completion", False),
    "keys": ("cachemgr.cli.cmd_keys:keys", False),
}
# `ls --remote` and `prune --remote` act on the bucket: the remote tier's handlers.
_REMOTE_VARIANTS = {"ls", "prune"}
_NEEDS_SERVER_ARGV = {"run", "warm", "key", "explain"}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``only`` just that command's (the rest costs a pod's start
    several milliseconds it never uses: ``run`` is on the hit path); errors and help read the same."""
    parser = Parser(
        prog="cachemgr",
        description="Compile cache manager for RBLN NPU modelserver pods: compile once per key, reuse everywhere.",
        epilog="examples:\n  cachemgr ls\n  cachemgr explain -- vllm serve MODEL --tensor-parallel-size 8\n"
        "  cachemgr COMMAND --help",
        formatter_class=FORMATTER,
    )
    parser.add_argument("--version", action="version", version=f"cachemgr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser, metavar="COMMAND")
    for name, add in _COMMANDS.items():
        if only is None or name == only:
            add(sub, name)
    return parser


def split_server_argv(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """cachemgr's own arguments, and the server argv after the first ``--``."""
    argv = list(argv)
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def _check_text(own: Sequence[str], server_argv: Sequence[str], environ: Mapping[str, str]) -> None:
    """Refuse bytes that are not UTF-8: Python keeps them as lone surrogates, which no key,
    record or log line can encode (a path made of such bytes cannot be keyed either)."""
    for where, words in (("argument", [*own, *server_argv]), ("environment variable", environ)):
        for word in words:
            value = word if where == "argument" else environ[word]
            if where != "argument" and not word.startswith(("CACHEMGR_", "VLLM_", "RBLN_")):
                continue
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                shown = repr(value.encode("utf-8", "surrogateescape"))[2:-1]  # the bytes as given
                name = f" {word}" if where != "argument" else ""
                raise UsageError(
                    f"{where}{name} '{shown[:60]}' is not valid UTF-8",
                    remedy="pass names, paths and values as UTF-8 text",
                ) from None


def _check_server_argv(command: str, server_argv: list[str]) -> None:
    if command in _NEEDS_SERVER_ARGV and not server_argv:
        raise UsageError(
            "the server's argv must follow '--'",
            remedy=f"e.g. cachemgr {command} -- vllm serve MODEL --tensor-parallel-size 4",
        )
    if server_argv and command not in _NEEDS_SERVER_ARGV:
        raise UsageError("this command takes no server argv after '--'", remedy="drop the part after '--'")


def parse(own: Sequence[str]) -> argparse.Namespace:
    """cachemgr's own arguments; an unknown one is a usage error of its command, named once."""
    parser = build_parser(own[0] if own and own[0] in _COMMANDS else None)
    args, extra = parser.parse_known_args(own)
    if extra:
        raise UsageError(
            f"unrecognized arguments: {' '.join(extra)[:200]}", remedy=f"see 'cachemgr {args.command} --help'"
        )
    return args


def _handler(
    command: str, args: argparse.Namespace
) -> Callable[[argparse.Namespace, list[str], Mapping[str, str]], int]:
    spec = _HANDLERS[command][0]
    if command in _REMOTE_VARIANTS and getattr(args, "remote", None) is not None:
        spec = f"cachemgr.cli.cmd_remote:{command}"
    module_name, _, func = spec.partition(":")
    handler: Callable[[argparse.Namespace, list[str], Mapping[str, str]], int] = getattr(
        importlib.import_module(module_name), func
    )
    return handler


def stderr_format(
    command: str, *, log_format: str | None, output: str | None, environ: Mapping[str, str]
) -> str | None:
    """What cachemgr writes on stderr, ``json`` or ``console`` (None: the pod's default, decided
    by :func:`cachemgr.core.log.resolve_format`: console on a terminal, JSON otherwise).

    ``run``, ``warm`` and ``probe`` write the pod's log: ``--log-format``, else
    ``CACHEMGR_LOG_FORMAT``. Every other command is a person's (``kubectl exec`` with or without
    ``-t``) unless asked: ``--log-format``, else JSON when its result is (``-o json``, ``-o
    yaml``: a script reads both streams), else console, whatever the pod's format.
    """
    if command in POD_COMMANDS or not command:
        return log_format or environ.get("CACHEMGR_LOG_FORMAT") or None
    if log_format:
        return log_format
    return "json" if output in ("json", "yaml") else "console"


def _words_format(command: str, own: Sequence[str], environ: Mapping[str, str]) -> str | None:
    """The stderr format of a command whose arguments did not parse, from its words as given:
    ``--log-format X`` and ``-o json`` in their plain spellings (an error must still come out in
    the form a script asked for)."""
    log_format = output = None
    for word, after in zip(own, [*own[1:], ""], strict=True):
        name, eq, value = word.partition("=")
        value = value if eq else after
        if name == "--log-format" and value in ("json", "console"):
            log_format = value
        elif name in ("-o", "--output") or (word.startswith("-o") and len(word) > 2 and not eq):
            output = word[2:] if name not in ("-o", "--output") else value
    return stderr_format(command, log_format=log_format, output=output, environ=environ)


def main(argv: Sequence[str] | None = None) -> int:
    own, server_argv = split_server_argv(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    command = own[0] if own and own[0] in _HANDLERS else ""
    fmt: str | None = None
    try:
        _check_text(own, server_argv, environ)
        args = parse(own)
        command = args.command
        fmt = stderr_format(
            command,
            log_format=getattr(args, "log_format", None),
            output=getattr(args, "output", None),
            environ=environ,
        )
        _check_server_argv(command, server_argv)
        if hasattr(args, "log_format"):
            from cachemgr.core.log import configure, resolve_format  # not for probes

            configure(resolve_format(fmt))
        return _handler(command, args)(args, server_argv, environ)
    except BaseException as error:  # noqa: BLE001  # the one error boundary: every failure gets a line and a code
        if isinstance(error, SystemExit):
            return int(error.code or 0) if isinstance(error.code, int | None) else int(ExitCode.USAGE)
        from cachemgr.cli.errors import report

        entrypoint = _HANDLERS.get(command, ("", False))[1]
        if fmt is None:
            fmt = _words_format(command, own, environ)
        return report(error, command=command, environ=environ, entrypoint=entrypoint, fmt=fmt)
