"""``cachemgr``: parse, call the library, render. Nothing else lives here.

Each command's handler is imported only when that command runs: ``cachemgr probe`` runs in
every pod every few seconds and must not pay for the libraries ``run`` needs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from cachemgr import __version__
from cachemgr.core.errors import ExitCode, UsageError
from cachemgr.volume.lease_defaults import DEFAULT_DURATION as DEFAULT_LEASE_DURATION

# command -> (handler "module:function", entrypoint?): entrypoints write the termination message.
_HANDLERS: dict[str, tuple[str, bool]] = {
    "run": ("cachemgr.cli.cmd_run:run", True),
    "warm": ("cachemgr.cli.cmd_run:warm", True),
    "key": ("cachemgr.cli.cmd_run:key", False),
    "demo": ("cachemgr.cli.cmd_run:demo", False),
    "explain": ("cachemgr.cli.cmd_inspect:explain", False),
    "ls": ("cachemgr.cli.cmd_inspect:ls", False),
    "show": ("cachemgr.cli.cmd_inspect:show", False),
    "du": ("cachemgr.cli.cmd_maintain:du", False),
    "verify": ("cachemgr.cli.cmd_maintain:verify", False),
    "prune": ("cachemgr.cli.cmd_maintain:prune", False),
    "locks": ("cachemgr.cli.cmd_inspect:locks", False),
    "probe": ("cachemgr.cli.cmd_probe:probe", False),
    "push": ("cachemgr.cli.cmd_remote:push", False),
    "pull": ("cachemgr.cli.cmd_remote:pull", False),
    "keys": ("cachemgr.cli.cmd_keys:keys", False),
}
# `ls --remote` and `prune --remote` act on the bucket: the remote tier's handlers.
_REMOTE_VARIANTS = {"ls", "prune"}
_NEEDS_SERVER_ARGV = {"run", "warm", "key", "explain"}


class _Parser(argparse.ArgumentParser):
    """Usage errors become UsageError (exit 64) with one line, not argparse's exit 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message}", remedy=f"see '{self.prog} --help'")


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


def _add_log(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default=_env("CACHEMGR_LOG_FORMAT"),
        help="log format on stderr [env CACHEMGR_LOG_FORMAT; default: console on a terminal, else json]",
    )


def _add_progress(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--progress-interval",
        default=_env("CACHEMGR_PROGRESS_INTERVAL"),
        metavar="DURATION",
        help="log progress (compile_progress, waiting_for_compile, ...) at most this often "
        "[env CACHEMGR_PROGRESS_INTERVAL; default 30s]",
    )


def _add_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-root",
        default=_env("CACHEMGR_CACHE_ROOT"),
        help="the role's compile cache volume [env CACHEMGR_CACHE_ROOT]",
    )


def _add_output(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", choices=["table", "json"], default="table", help="output format")


def _add_key(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache key")
    group.add_argument("--role", default=_env("CACHEMGR_ROLE"), help="prefill or decode [env CACHEMGR_ROLE]")
    group.add_argument(
        "--compiler-version",
        default=_env("CACHEMGR_COMPILER_VERSION"),
        help="RBLN Compiler version; default: installed rebel-compiler [env CACHEMGR_COMPILER_VERSION]",
    )
    group.add_argument(
        "--npu-type",
        default=_env("CACHEMGR_NPU_TYPE"),
        help="NPU type, e.g. RBLN-CA25; default: RBLN_FORCE_NPU_NAME, else the device [env CACHEMGR_NPU_TYPE]",
    )
    group.add_argument(
        "--strategy",
        choices=["vllm", "command"],
        default=None,
        help="who compiles: the vllm server itself (default for 'vllm serve') or --compile-cmd",
    )
    group.add_argument("--compile-cmd", default=None, help="compiler command line naming {output_dir}")
    group.add_argument(
        "--key-env",
        action="append",
        default=[],
        metavar="NAME",
        help="also key on this environment variable (repeatable)",
    )


def _add_run(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run")
    group.add_argument(
        "--state-dir",
        default=_env("CACHEMGR_STATE_DIR"),
        help="pod-local state for probes [env CACHEMGR_STATE_DIR; default /tmp/cachemgr-state]",
    )
    group.add_argument("--on-miss", choices=["compile", "fail"], default="compile")
    group.add_argument(
        "--lease-duration",
        default=f"{DEFAULT_LEASE_DURATION:g}",
        metavar="SECONDS",
        help=f"lease duration (default {DEFAULT_LEASE_DURATION:g})",
    )
    group.add_argument(
        "--lease-heartbeat", default=None, metavar="SECONDS", help="default: a third of the lease"
    )
    group.add_argument(
        "--lease-confirm",
        default=_env("CACHEMGR_LEASE_CONFIRM"),
        metavar="SECONDS",
        help="hold a won lease this long before compiling, longer than the volume's metadata cache "
        "(default 2, 0 on a local filesystem) [env CACHEMGR_LEASE_CONFIRM]",
    )
    group.add_argument(
        "--wait-timeout", default=None, metavar="SECONDS", help="give up waiting (exit 75); default: wait"
    )
    group.add_argument(
        "--expected-size", default=None, metavar="BYTES", help="expected compile output, e.g. 150Gi"
    )
    group.add_argument("--space-check", choices=["fail", "warn"], default="fail")
    group.add_argument("--auto-prune", choices=["off", "incompatible"], default="off")
    group.add_argument("--verify", choices=["fast", "full"], default="fast")
    group.add_argument(
        "--health-url", default=None, help="server health URL; default http://127.0.0.1:PORT/health"
    )
    group.add_argument(
        "--stall-timeout", default="30m", metavar="DURATION", help="no compile progress this long is a stall"
    )
    group.add_argument(
        "--status-port",
        type=_port,
        default=None,
        help="serve /livez /readyz /startupz /status /metrics (0: any free port)",
    )
    group.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="second tier on S3-compatible storage, s3://bucket/prefix: download on a miss, upload after "
        "a compile [env CACHEMGR_REMOTE; endpoint: CACHEMGR_REMOTE_ENDPOINT; default: off]",
    )
    _add_signing(group)
    _add_trusted(group)


def _add_trusted(parser: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    parser.add_argument(
        "--trusted-keys",
        default=_env("CACHEMGR_TRUSTED_KEYS"),
        metavar="KEYS",
        help="public keys NAME:BASE64, separated by spaces: use only entries one of them signed "
        "[env CACHEMGR_TRUSTED_KEYS; default: trust every entry]",
    )


def _add_signing(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--signing-key-file",
        default=_env("CACHEMGR_SIGNING_KEY_FILE"),
        metavar="FILE",
        help="sign what this pod publishes with this secret key ('cachemgr keys generate') "
        "[env CACHEMGR_SIGNING_KEY_FILE; default: unsigned]",
    )


def _port(text: str) -> int:
    """A TCP port, 0-65535 (argparse turns the error into a usage error, exit 64)."""
    port = int(text) if text.isascii() and text.isdigit() and len(text) <= 5 else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a port number (0-65535)")
    return port


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``only`` just that command's (the rest costs a pod's start
    several milliseconds it never uses: ``run`` is on the hit path); errors and help read the same."""
    parser = _Parser(prog="cachemgr", description="Compile cache manager for RBLN NPU modelserver pods.")
    parser.add_argument("--version", action="version", version=f"cachemgr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, add in _COMMANDS.items():
        if only is None or name == only:
            add(sub, name)
    return parser


def _with(cmd: argparse.ArgumentParser, *groups: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add the option groups several commands share (``--cache-root``, ``--output``...)."""
    for add in groups:
        add(cmd)


def _add_run_command(sub: Any, name: str) -> None:
    text = {
        "run": "the pod entrypoint: reuse or compile once, then launch and supervise the server",
        "warm": "fill the cache for this argv (a Job before a rollout) and exit 0",
    }[name]
    cmd = sub.add_parser(
        name, help=text, description=f"{text}. Usage: cachemgr {name} [options] -- SERVER ARGV"
    )
    _with(cmd, _add_root, _add_key, _add_run, _add_progress, _add_log)


def _add_key_command(sub: Any, name: str) -> None:
    if name == "key":
        cmd = sub.add_parser(
            "key", help="print the cache key of -- SERVER ARGV and where each input came from"
        )
    else:
        cmd = sub.add_parser("explain", help="hit or miss for -- SERVER ARGV here, and why")
        _add_root(cmd)
        _add_trusted(cmd)
    _with(cmd, _add_key, _add_output, _add_log)


def _add_demo_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="two prefill and two decode pods, cold then warm, with stand-ins")
    cmd.add_argument("--dir", default="demo-cache", help="where the demo volumes go (default ./demo-cache)")
    cmd.add_argument("--compile-seconds", type=float, default=3.0, help="stand-in compile time")
    cmd.add_argument(
        "--remote",
        action="store_true",
        help="two clusters and one bucket (a local SeaweedFS: needs weed, boto3)",
    )
    _add_log(cmd)


def _add_listing_command(sub: Any, name: str) -> None:
    text = {
        "ls": "one row per entry: key, model, role, compiler, NPU, size, ages, users, status",
        "du": "volume size, used, free; cache bytes by entry and compiler; what prune could free",
        "locks": "each lease: key, holder pod and node, held for, last refresh, stale or not",
    }[name]
    cmd = sub.add_parser(name, help=text)
    _with(cmd, _add_root, _add_output, _add_compat, _add_log)
    if name == "ls":
        _add_remote(cmd, listing=True)
        _add_trusted(cmd)


def _add_show_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="every key input, manifest summary, users and failures of one entry")
    cmd.add_argument("key", help="a unique prefix of the key, or the entry name")
    _with(cmd, _add_root, _add_output, _add_compat, _add_trusted, _add_log)


def _add_verify_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(
        name, help="hash-check entries (and with trusted keys, their signatures); --fix moves bad ones aside"
    )
    cmd.add_argument("keys", nargs="*", help="key prefixes (default: all)")
    cmd.add_argument("--fix", action="store_true")
    _with(cmd, _add_root, _add_output, _add_trusted, _add_progress, _add_log)


def _add_prune_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="plan, print, then remove entries (never one in use)")
    cmd.add_argument(
        "--incompatible",
        action="store_true",
        help="entries no pod of this image can use (another compiler major.minor)",
    )
    cmd.add_argument(
        "--npu",
        action="append",
        default=[],
        metavar="TYPE",
        help="entries compiled for this NPU type, e.g. RBLN-CA12 (repeatable): pods of that hardware "
        "sharing the volume use them, so they go only when named",
    )
    cmd.add_argument("--unused-for", metavar="DURATION", help="entries unused for this long, e.g. 14d")
    cmd.add_argument("--keep-bytes", metavar="SIZE", help="remove least recently used until the cache fits")
    cmd.add_argument("--stale-staging", action="store_true", help="attempts left by dead pods")
    cmd.add_argument("--damaged", action="store_true", help="quarantined entries")
    cmd.add_argument("--dry-run", action="store_true", help="print the plan only")
    cmd.add_argument("--yes", action="store_true", help="do it without asking (required without a TTY)")
    _add_remote(cmd, listing=True)
    cmd.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY",
        help="with --remote: this entry (repeatable); --unused-for counts from the upload there",
    )
    _with(cmd, _add_root, _add_output, _add_compat, _add_progress, _add_log)


def _add_push_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="upload published entries to the remote tier (manifest last)")
    cmd.add_argument("keys", nargs="*", help="key prefixes or entry names (default: every entry)")
    cmd.add_argument("--force", action="store_true", help="upload even if the remote has the entry")
    _add_remote(cmd)
    _with(cmd, _add_root, _add_output, _add_log)


def _add_pull_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="download an entry from the remote tier, check it, publish it here")
    cmd.add_argument("key", help="a key prefix or entry name ('cachemgr ls --remote' lists them)")
    _add_remote(cmd)
    _with(cmd, _add_root, _add_output, _add_trusted, _add_log)


def _add_keys_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="signing keys: generate a key pair, or print a secret key's public key")
    cmd.add_argument("action", choices=["generate", "public"])
    cmd.add_argument("--name", help="generate: the key's name, NAME-N (builder-1, then builder-2 to rotate)")
    cmd.add_argument(
        "--secret-file",
        required=True,
        metavar="FILE",
        help="the secret key file (generate: written with mode 0600, never over an existing file)",
    )
    _add_log(cmd)


def _add_probe_command(sub: Any, name: str) -> None:
    cmd = sub.add_parser(name, help="Kubernetes exec probe: startup, live or ready")
    cmd.add_argument("kind", choices=["startup", "live", "ready"])
    cmd.add_argument("--state-dir", default=_env("CACHEMGR_STATE_DIR"))
    cmd.add_argument("--timeout", type=float, default=1.0, help="health request timeout (ready)")


# Each command's arguments, in the order `cachemgr --help` lists them.
_COMMANDS: dict[str, Callable[[Any, str], None]] = {
    "run": _add_run_command,
    "warm": _add_run_command,
    "key": _add_key_command,
    "explain": _add_key_command,
    "demo": _add_demo_command,
    "ls": _add_listing_command,
    "du": _add_listing_command,
    "locks": _add_listing_command,
    "show": _add_show_command,
    "verify": _add_verify_command,
    "prune": _add_prune_command,
    "push": _add_push_command,
    "pull": _add_pull_command,
    "keys": _add_keys_command,
    "probe": _add_probe_command,
}


def _add_remote(parser: argparse.ArgumentParser, *, listing: bool = False) -> None:
    if listing:  # `ls --remote`: the flag alone means the remote in CACHEMGR_REMOTE
        parser.add_argument(
            "--remote",
            nargs="?",
            const="",
            default=None,
            metavar="URL",
            help="act on the remote tier (s3://bucket/prefix; default: CACHEMGR_REMOTE) instead of the volume",
        )
        return
    parser.add_argument(
        "--remote", default=None, metavar="URL", help="s3://bucket/prefix [env CACHEMGR_REMOTE]"
    )


def _add_compat(parser: argparse.ArgumentParser) -> None:
    """Inspection needs this image's compiler to mark incompatible entries, its NPU to tell other NPUs'."""
    parser.add_argument("--compiler-version", default=_env("CACHEMGR_COMPILER_VERSION"))
    parser.add_argument("--npu-type", default=_env("CACHEMGR_NPU_TYPE"))


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
            f"cachemgr {command} needs the server's argv after '--'",
            remedy=f"e.g. cachemgr {command} -- vllm serve MODEL --tensor-parallel-size 4",
        )
    if server_argv and command not in _NEEDS_SERVER_ARGV:
        raise UsageError(f"cachemgr {command} takes no server argv", remedy="drop the part after '--'")


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


def main(argv: Sequence[str] | None = None) -> int:
    own, server_argv = split_server_argv(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    command = own[0] if own and own[0] in _HANDLERS else "cachemgr"
    try:
        _check_text(own, server_argv, environ)
        args = build_parser(own[0] if own and own[0] in _COMMANDS else None).parse_args(own)
        command = args.command
        _check_server_argv(command, server_argv)
        if hasattr(args, "log_format"):
            from cachemgr.core.log import configure, resolve_format  # not for probes

            configure(resolve_format(args.log_format))
        return _handler(command, args)(args, server_argv, environ)
    except BaseException as error:  # noqa: BLE001  # the one error boundary: every failure gets a line and a code
        if isinstance(error, SystemExit):
            return int(error.code or 0) if isinstance(error.code, int | None) else int(ExitCode.USAGE)
        from cachemgr.cli.errors import report

        entrypoint = _HANDLERS.get(command, ("", False))[1]
        return report(error, command=command, environ=environ, entrypoint=entrypoint)
