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
from typing import Any, NoReturn

from cachemgr import __version__
from cachemgr.core.errors import ExitCode, UsageError
from cachemgr.core.units import parse_duration, parse_size
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
    "stats": ("cachemgr.cli.cmd_inspect:stats", False),
    "probe": ("cachemgr.cli.cmd_probe:probe", False),
    "push": ("cachemgr.cli.cmd_remote:push", False),
    "pull": ("cachemgr.cli.cmd_remote:pull", False),
    "completion": ("cachemgr.cli.cmd_completion:completion", False),
}
# `ls --remote` and `prune --remote` act on the bucket: the remote tier's handlers.
_REMOTE_VARIANTS = {"ls", "prune"}
_NEEDS_SERVER_ARGV = {"run", "warm", "key", "explain"}
DURATION = "DURATION"  # the one metavar of every duration option (tests/test_help.py)
SIZE = "SIZE"
_DURATION_HELP = "a plain number is seconds; or 30s, 15m, 2h, 14d"
_FORMATTER = argparse.RawDescriptionHelpFormatter


class _Parser(argparse.ArgumentParser):
    """Usage errors become UsageError (exit 64) with one line, not argparse's exit 2.

    The line names no command: the error report puts ``cachemgr COMMAND:`` before it, once.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, remedy=f"see '{self.prog} --help'")


def _env(name: str) -> str | None:
    return os.environ.get(name) or None


# --- value types: one form for each kind of value -------------------------------------------------


def duration(text: str) -> float:
    """A duration option's value in seconds (argparse turns the error into a usage error, exit 64)."""
    try:
        return parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def size(text: str) -> int:
    """A size option's value in bytes."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _port(text: str) -> int:
    """A TCP port, 0-65535 (argparse turns the error into a usage error, exit 64)."""
    port = int(text) if text.isascii() and text.isdigit() and len(text) <= 5 else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a port number (0-65535)")
    return port


def _duration_option(parser: Any, flag: str, *, help: str, default: float | str | None = None) -> None:
    parser.add_argument(
        flag, type=duration, default=default, metavar=DURATION, help=f"{help} ({_DURATION_HELP})"
    )


# --- option groups several commands share --------------------------------------------------------


def _add_log(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default=_env("CACHEMGR_LOG_FORMAT"),
        help="log format on stderr [env CACHEMGR_LOG_FORMAT; default: console on a terminal, else json]",
    )


def _add_progress(parser: argparse.ArgumentParser) -> None:
    _duration_option(
        parser,
        "--progress-interval",
        help="log progress (compile_progress, waiting_for_compile, verify_progress...) at most this often "
        "[env CACHEMGR_PROGRESS_INTERVAL; default 30s]",
    )


def _add_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-root",
        default=_env("CACHEMGR_CACHE_ROOT"),
        metavar="DIR",
        help="where the role's compile cache volume is mounted [env CACHEMGR_CACHE_ROOT]",
    )


_OUTPUT_HELP = {
    "table": "aligned columns fitted to the terminal (80 columns off one)",
    "wide": "every column, nothing shortened",
    "json": "the result as JSON",
    "yaml": "the result as YAML",
    "name": "KIND/NAME lines",
}


def _add_output(parser: argparse.ArgumentParser, *forms: str) -> None:
    """``-o`` with the forms this command has; tables also take ``--no-headers``."""
    forms = forms or ("table", "wide", "json", "yaml", "name")
    parser.add_argument(
        "-o",
        "--output",
        choices=list(forms),
        default="table",
        help="output format: " + "; ".join(f"{f}: {_OUTPUT_HELP[f]}" for f in forms),
    )
    parser.add_argument(
        "--no-headers", action="store_true", help="table rows only: no headers, titles or notes (for scripts)"
    )


def _add_identity(group: Any) -> None:
    """This image's compiler and NPU: the key's inputs, and what inspection judges entries by."""
    group.add_argument(
        "--compiler-version",
        default=_env("CACHEMGR_COMPILER_VERSION"),
        metavar="VERSION",
        help="this image's RBLN Compiler version; default: the installed rebel-compiler "
        "[env CACHEMGR_COMPILER_VERSION]",
    )
    group.add_argument(
        "--npu-type",
        default=_env("CACHEMGR_NPU_TYPE"),
        metavar="TYPE",
        help="this pod's NPU type, e.g. RBLN-CA25; default: the device, else RBLN_FORCE_NPU_NAME "
        "[env CACHEMGR_NPU_TYPE]",
    )


def _add_key(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache key")
    group.add_argument(
        "--role", default=_env("CACHEMGR_ROLE"), metavar="ROLE", help="prefill or decode [env CACHEMGR_ROLE]"
    )
    _add_identity(group)
    group.add_argument(
        "--strategy",
        choices=["vllm", "command"],
        default=None,
        help="who compiles: the vllm server itself (default for 'vllm serve') or --compile-cmd",
    )
    group.add_argument(
        "--compile-cmd",
        default=None,
        metavar="CMD",
        help="with --strategy command: the compiler's command line, naming {output_dir}",
    )
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
        metavar="DIR",
        help="pod-local state for the probes [env CACHEMGR_STATE_DIR; default /tmp/cachemgr-state]",
    )
    group.add_argument(
        "--on-miss",
        choices=["compile", "fail"],
        default="compile",
        help="on a miss, compile (default) or fail with exit 69 (pods that rely on a warm Job)",
    )
    _duration_option(
        group,
        "--lease-duration",
        default=f"{DEFAULT_LEASE_DURATION:g}",
        help=f"a silent lease holder is taken over after this long (default {DEFAULT_LEASE_DURATION:g}s)",
    )
    _duration_option(
        group, "--lease-heartbeat", help="how often the holder refreshes it (default: a third of the lease)"
    )
    _duration_option(
        group,
        "--lease-confirm",
        help="hold a won lease this long before compiling, longer than the volume's metadata cache "
        "(default 2s, 0 on a local filesystem) [env CACHEMGR_LEASE_CONFIRM]",
    )
    _duration_option(
        group, "--wait-timeout", help="give up waiting for a peer's compile (exit 75); default: wait"
    )
    group.add_argument(
        "--expected-size",
        type=size,
        default=None,
        metavar=SIZE,
        help="the compile's expected output, e.g. 150Gi (default: learned from earlier compiles, else the weights)",
    )
    group.add_argument(
        "--space-check",
        choices=["fail", "warn"],
        default="fail",
        help="too little free space for the expected size: fail with exit 73 (default) or warn and compile",
    )
    group.add_argument(
        "--auto-prune",
        choices=["off", "incompatible"],
        default="off",
        help="before compiling, remove unused entries of other compiler versions (default off)",
    )
    group.add_argument(
        "--verify",
        choices=["fast", "full"],
        default="fast",
        help="check a hit's files by size and mtime (fast, default) or also by hash (full: reads every byte)",
    )
    group.add_argument(
        "--health-url",
        default=None,
        metavar="URL",
        help="the server's health URL (default http://127.0.0.1:PORT/health from its --port)",
    )
    _duration_option(
        group,
        "--stall-timeout",
        default="30m",
        help="a compile or load with no CPU, writes or output this long is stalled: liveness fails",
    )
    group.add_argument(
        "--status-port",
        type=_port,
        default=None,
        metavar="PORT",
        help="serve /livez /readyz /startupz /status /metrics on this port (0: any free port)",
    )
    group.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="second tier on S3-compatible storage, s3://bucket/prefix: download on a miss, upload after "
        "a compile [env CACHEMGR_REMOTE; endpoint: CACHEMGR_REMOTE_ENDPOINT; default: off]",
    )


def _add_compat(parser: argparse.ArgumentParser) -> None:
    """Inspection needs this image's compiler to mark incompatible entries, its NPU to tell other NPUs'."""
    _add_identity(parser.add_argument_group("this image"))


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
        "--remote",
        default=None,
        metavar="URL",
        help="the remote tier, s3://bucket/prefix [env CACHEMGR_REMOTE]",
    )


# --- the commands ----------------------------------------------------------------------------------


def _command(
    sub: Any, name: str, summary: str, about: str, examples: Sequence[str]
) -> argparse.ArgumentParser:
    """A command's parser: its purpose first, its examples last (``cachemgr NAME --help``)."""
    lines = "\n".join(f"  {example}" for example in examples)
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=f"{summary[:1].upper()}{summary[1:]}.\n\n{about}",
        epilog=f"examples:\n{lines}",
        formatter_class=_FORMATTER,
    )
    return parser


_SERVER = "vllm serve MiniMaxAI/MiniMax-M2.7 --tensor-parallel-size 8 --max-model-len 32768"


def _add_run_command(sub: Any, name: str) -> None:
    if name == "run":
        cmd = _command(
            sub,
            name,
            "the pod entrypoint: reuse or compile once, then launch and supervise the server",
            "Computes the key of -- SERVER ARGV, loads the role's published entry or takes the key's lease\n"
            "and compiles it once (peers wait), then runs the server on a pod-local view of the entry.\n"
            "Usage: cachemgr run [options] -- SERVER ARGV",
            [
                f"cachemgr run --status-port 9090 -- {_SERVER} --port 8000",
                f"cachemgr run --on-miss fail -- {_SERVER}",
            ],
        )
    else:
        cmd = _command(
            sub,
            name,
            "fill the cache for this argv (a Job before a rollout) and exit 0",
            "The same flow as 'run', for a Job: it exits 0 once the entry is published (or was there),\n"
            "with a one-line summary, and writes no probe state. Usage: cachemgr warm [options] -- SERVER ARGV",
            [
                f"cachemgr warm -- {_SERVER} --model-impl vllm",
                f"cachemgr warm --remote s3://bucket/prod -- {_SERVER}",
            ],
        )
    _add_root(cmd)
    _add_key(cmd)
    _add_run(cmd)
    _add_progress(cmd)
    _add_log(cmd)


def _add_key_command(sub: Any, name: str) -> None:
    if name == "key":
        cmd = _command(
            sub,
            name,
            "print the cache key of -- SERVER ARGV and where each input came from",
            "Needs no volume: the key is computed as 'cachemgr run' would, from this image's compiler,\n"
            "NPU and the server's argv; runtime-only flags (host, port...) are named and left out.",
            [f"cachemgr key -- {_SERVER}", f"cachemgr key -o json -- {_SERVER} | jq .key"],
        )
        _add_key(cmd)
        _add_output(cmd, "table", "json", "yaml")
    else:
        cmd = _command(
            sub,
            name,
            "hit or miss for -- SERVER ARGV here, and on a miss what differs from the nearest entries",
            "The same argv as the pod's 'cachemgr run -- ...'. A hit names the entry; a miss ranks the\n"
            "role's entries by how few key inputs differ and says what to do.",
            [
                f"cachemgr explain -- {_SERVER} --port 8000",
                f"cachemgr explain --compiler-version 0.14.0 -- {_SERVER}",
            ],
        )
        _add_root(cmd)
        _add_key(cmd)
        _add_output(cmd, "table", "json", "yaml")
    _add_log(cmd)


def _add_demo_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "two prefill and two decode pods, cold then warm, with the stand-in compiler and server",
        "Runs four real 'cachemgr run' processes against the stand-in vllm server (no NPU needed) and\n"
        "checks the promise: one compile per role when cold, none when warm.",
        ["cachemgr demo", "cachemgr demo --dir /tmp/demo --compile-seconds 1", "cachemgr demo --remote"],
    )
    cmd.add_argument(
        "--dir", default="demo-cache", metavar="DIR", help="where the demo volumes go (default ./demo-cache)"
    )
    _duration_option(
        cmd, "--compile-seconds", default="3", help="how long the stand-in compiler takes (default 3s)"
    )
    cmd.add_argument(
        "--remote",
        action="store_true",
        help="two clusters and one bucket (a local SeaweedFS: needs weed, boto3)",
    )
    _add_log(cmd)


def _add_ls_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "what is cached: one row per entry, then compile attempts, failed compiles and quarantine",
        "Reads each entry's summary (never its files: 'cachemgr verify' checks those), its users and\n"
        "its hits. Runs in any pod of the role, on a read-only volume too.",
        ["cachemgr ls", "cachemgr ls -o wide", "cachemgr ls -o json | jq '.[] | select(.kind == \"entry\")'"],
    )
    _add_root(cmd)
    _add_output(cmd)
    _add_compat(cmd)
    _add_remote(cmd, listing=True)
    _add_log(cmd)


def _add_du_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "how much space: the volume as the pod can use it, the cache by part, compiler and entry",
        "Ends with what each 'cachemgr prune' selector would free now, never counting an entry in use.",
        ["cachemgr du", "cachemgr du -o json | jq .prunable"],
    )
    _add_root(cmd)
    _add_output(cmd, "table", "wide", "json", "yaml")
    _add_compat(cmd)
    _add_log(cmd)


def _add_locks_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "who is compiling: each compile lease, its holder, and whether it is live, stalled or stale",
        "Ages are by this node's clock from the lease marker's mtime; the PROGRESS section is the\n"
        "compile as its holder reports it.",
        ["cachemgr locks", "cachemgr locks -o wide", "cachemgr locks -o json"],
    )
    _add_root(cmd)
    _add_output(cmd)
    _add_log(cmd)


def _add_stats_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "how well the cache works: hits, misses, compiles and the compile time saved, per entry",
        "Counted from the volume's own records (the use record each pod start leaves, the entries'\n"
        "summaries and the failure records): every pod of the role, since each entry was published.",
        ["cachemgr stats", "cachemgr stats -o json | jq .volume"],
    )
    _add_root(cmd)
    _add_output(cmd)
    _add_log(cmd)


def _add_show_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "everything about one key: inputs, files check, users, lease, attempts and failures",
        "KEY is a unique prefix of the key, or the entry's name. The status comes from the check\n"
        "'show' makes (every file's size and mtime against the manifest; 'verify' hashes them).",
        ["cachemgr show 661096f8", "cachemgr show 661096f8 -o json | jq .failures"],
    )
    cmd.add_argument("key", metavar="KEY", help="a unique prefix of the key, or the entry name")
    _add_root(cmd)
    _add_output(cmd, "table", "json", "yaml")
    _add_compat(cmd)
    _add_log(cmd)


def _add_verify_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "is anything damaged: hash every file of the entries against their manifests",
        "Exits 74 when it finds damage, also with --fix (damage on a volume is worth an alert even\n"
        "once moved aside). --fix moves only damaged entries to quarantine/.",
        ["cachemgr verify", "cachemgr verify 661096f8", "cachemgr verify --fix"],
    )
    cmd.add_argument(
        "keys", nargs="*", metavar="KEY", help="key prefixes or entry names (default: every entry)"
    )
    cmd.add_argument(
        "--fix",
        action="store_true",
        help="move damaged entries to quarantine/ (the next start compiles them)",
    )
    _add_root(cmd)
    _add_output(cmd)
    _add_progress(cmd)
    _add_log(cmd)


def _add_prune_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "what can go: plan, then remove in a safe order, never an entry in use",
        "At least one selector. Without --yes it asks on a terminal, and without one prints the plan\n"
        "and exits 64; --dry-run only prints the plan.",
        [
            "cachemgr prune --incompatible --dry-run",
            "cachemgr prune --unused-for 14d --yes",
            "cachemgr prune --for-npu RBLN-CA12 --yes",
        ],
    )
    group = cmd.add_argument_group("what may go (selectors)")
    group.add_argument(
        "--incompatible",
        action="store_true",
        help="entries no pod of this image can use (another compiler major.minor)",
    )
    group.add_argument(
        "--for-npu",
        action="append",
        default=[],
        dest="for_npu",
        metavar="TYPE",
        help="entries compiled for this NPU type, e.g. RBLN-CA12 (repeatable): pods of that hardware "
        "sharing the volume use them, so they go only when named",
    )
    group.add_argument(
        "--npu",
        action="append",
        default=[],
        dest="npu",
        metavar="TYPE",
        help="deprecated spelling of --for-npu",
    )
    _duration_option(group, "--unused-for", help="entries unused for this long, e.g. 14d")
    group.add_argument(
        "--keep-bytes",
        type=size,
        default=None,
        metavar=SIZE,
        help="remove least recently used entries until the cache fits, e.g. 150Gi",
    )
    group.add_argument(
        "--stale-staging", action="store_true", help="compile attempts (and their leases) left by dead pods"
    )
    group.add_argument("--damaged", action="store_true", help="quarantined and damaged entries")
    group.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY",
        help="with --remote: this entry (repeatable); --unused-for counts from the upload there",
    )
    cmd.add_argument("--dry-run", action="store_true", help="print the plan only")
    cmd.add_argument("--yes", action="store_true", help="do it without asking (required without a terminal)")
    _add_remote(cmd, listing=True)
    _add_root(cmd)
    _add_output(cmd)
    _add_compat(cmd)
    _add_progress(cmd)
    _add_log(cmd)


def _add_push_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "upload published entries to the remote tier (manifest last)",
        "Entries already in the remote are skipped. Exits 73 when the bucket is full, 74 when the\n"
        "remote or the volume cannot be used.",
        ["cachemgr push --remote s3://bucket/prod", "cachemgr push 661096f8"],
    )
    cmd.add_argument(
        "keys", nargs="*", metavar="KEY", help="key prefixes or entry names (default: every entry)"
    )
    cmd.add_argument("--force", action="store_true", help="upload even if the remote has the entry")
    _add_remote(cmd)
    _add_root(cmd)
    _add_output(cmd, "table", "wide", "json", "yaml")
    _add_log(cmd)


def _add_pull_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "download an entry from the remote tier, check it, publish it here",
        "The download is checked against the remote manifest before it is published by the same\n"
        "atomic rename a compile uses.",
        ["cachemgr pull 661096f8", "cachemgr pull 661096f8 --remote s3://bucket/prod"],
    )
    cmd.add_argument(
        "key", metavar="KEY", help="a key prefix or entry name ('cachemgr ls --remote' lists them)"
    )
    _add_remote(cmd)
    _add_root(cmd)
    _add_output(cmd, "table", "wide", "json", "yaml")
    _add_log(cmd)


def _add_probe_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "Kubernetes exec probe: startup, live or ready",
        "Reads the state record 'cachemgr run' keeps in its state dir; prints one line and exits 0\n"
        "(pass) or 1 (fail). Standard library only: it runs in every pod every few seconds.",
        ["cachemgr probe startup", "cachemgr probe ready --timeout 2s"],
    )
    cmd.add_argument("kind", choices=["startup", "live", "ready"], help="which probe")
    cmd.add_argument(
        "--state-dir",
        default=_env("CACHEMGR_STATE_DIR"),
        metavar="DIR",
        help="the run's pod-local state [env CACHEMGR_STATE_DIR; default /tmp/cachemgr-state]",
    )
    _duration_option(
        cmd,
        "--timeout",
        default="1",
        help="ready: how long the server's health request may take (default 1s)",
    )


def _add_completion_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "print a shell completion script for bash or zsh",
        "Generated from this parser (shtab), so every command and option completes as it is today.",
        [
            "source <(cachemgr completion bash)",
            'cachemgr completion zsh > "${fpath[1]}/_cachemgr"',
        ],
    )
    cmd.add_argument("shell", choices=["bash", "zsh"], help="the shell to complete in")


# Each command's arguments, in the order `cachemgr --help` lists them.
_COMMANDS: dict[str, Callable[[Any, str], None]] = {
    "run": _add_run_command,
    "warm": _add_run_command,
    "key": _add_key_command,
    "explain": _add_key_command,
    "demo": _add_demo_command,
    "ls": _add_ls_command,
    "du": _add_du_command,
    "locks": _add_locks_command,
    "stats": _add_stats_command,
    "show": _add_show_command,
    "verify": _add_verify_command,
    "prune": _add_prune_command,
    "push": _add_push_command,
    "pull": _add_pull_command,
    "probe": _add_probe_command,
    "completion": _add_completion_command,
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The whole parser, or with ``only`` just that command's (the rest costs a pod's start
    several milliseconds it never uses: ``run`` is on the hit path); errors and help read the same."""
    parser = _Parser(
        prog="cachemgr",
        description="Compile cache manager for RBLN NPU modelserver pods: compile once per key, reuse everywhere.",
        epilog="examples:\n  cachemgr ls\n  cachemgr explain -- vllm serve MODEL --tensor-parallel-size 8\n"
        "  cachemgr COMMAND --help",
        formatter_class=_FORMATTER,
    )
    parser.add_argument("--version", action="version", version=f"cachemgr {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
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


def main(argv: Sequence[str] | None = None) -> int:
    own, server_argv = split_server_argv(sys.argv[1:] if argv is None else argv)
    environ = dict(os.environ)
    command = own[0] if own and own[0] in _HANDLERS else ""
    try:
        _check_text(own, server_argv, environ)
        args = parse(own)
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
