"""The options commands share, and one form for each kind of value: durations (``90``, ``90s``,
``15m``, ``1h30m``: a plain number is seconds), sizes (``150Gi``, ``512Mi``, bytes), ports, the
``-o`` forms. Every option has a help text (tests/test_help.py holds them to it)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn

from cachemgr.core.errors import UsageError
from cachemgr.core.units import parse_duration, parse_size
from cachemgr.volume.lease_defaults import DEFAULT_DURATION as DEFAULT_LEASE_DURATION


class Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's, sized without ``shutil``: argparse makes a formatter for every option it adds
    (to check the metavar), and its own imports ``shutil`` (with ``bz2``, ``lzma`` and ``fnmatch``,
    2 ms) to ask the terminal's width, on every ``cachemgr run``. The same width, the same way:
    ``$COLUMNS``, else the terminal's, else 80; minus 2."""

    def __init__(
        self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None
    ) -> None:
        super().__init__(prog, indent_increment, max_help_position, width or _columns() - 2)

    def _split_lines(self, text: str, width: int) -> list[str]:
        """An option's help, broken at spaces only: a flag (``--max-model-len``), a path or a URL
        is never cut at a hyphen, and a word longer than the room stays whole."""
        import textwrap  # only when help is shown

        return textwrap.wrap(" ".join(text.split()), width, break_long_words=False, break_on_hyphens=False)

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """The description and examples as written where they fit the terminal; a paragraph wider
        than it is reflowed, and an example too long for it is continued after `` \\`` (it still
        copies and runs whole: cachemgr.cli.render.fit_command)."""
        from cachemgr.cli.render import fit_command, fit_text  # only when help is shown

        room = width + len(indent)
        out = []
        for paragraph in text.split("\n\n"):
            lines = [indent + line for line in paragraph.split("\n")]
            if lines[0].strip() == "examples:":
                lines[1:] = [fit_command(line, room) for line in lines[1:]]
            elif any(len(line) > room for line in lines):
                lines = [fit_text(indent + " ".join(line.strip() for line in lines), room, hang=0)]
            out.append("\n".join(lines))
        return "\n\n".join(out)


def _columns() -> int:
    try:
        columns = int(os.environ.get("COLUMNS", "0"))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


FORMATTER = Formatter


def env(name: str) -> str | None:
    return os.environ.get(name) or None


DURATION = "DURATION"  # the one metavar of every duration option (tests/test_help.py)
SIZE = "SIZE"
DURATION_HELP = "a plain number is seconds; or 30s, 15m, 2h, 14d"


class Parser(argparse.ArgumentParser):
    """Usage errors become UsageError (exit 64) with one line, not argparse's exit 2.

    The line names no command: the error report puts ``cachemgr COMMAND:`` before it, once.
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(message, remedy=f"see '{self.prog} --help'")


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


def port(text: str) -> int:
    """A TCP port, 0-65535 (argparse turns the error into a usage error, exit 64)."""
    port = int(text) if text.isascii() and text.isdigit() and len(text) <= 5 else -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a port number (0-65535)")
    return port


def duration_option(parser: Any, flag: str, *, help: str, default: float | str | None = None) -> None:
    parser.add_argument(
        flag, type=duration, default=default, metavar=DURATION, help=f"{help} ({DURATION_HELP})"
    )


# --- option groups several commands share --------------------------------------------------------


# The commands a pod runs as itself (its entrypoint, its warm Job, its probes): their stderr is the
# pod's log, in the pod's format (CACHEMGR_LOG_FORMAT, which the chart sets for the whole pod).
# Every other command is run by a person (kubectl exec, with or without -t) or a script that says
# so with -o json: its stderr is for a person unless asked otherwise (docs/reference.md, "What
# a command writes on stderr").
POD_COMMANDS = frozenset({"run", "warm", "probe"})


def add_log(parser: argparse.ArgumentParser, *, pod: bool = False) -> None:
    if pod:
        parser.add_argument(
            "--log-format",
            choices=["json", "console"],
            default=env("CACHEMGR_LOG_FORMAT"),
            help="log format on stderr [env CACHEMGR_LOG_FORMAT; default: console on a terminal, else json]",
        )
        return
    parser.add_argument(
        "--log-format",
        choices=["json", "console"],
        default=None,
        help="format of notes, warnings, errors and log events on stderr (default: console, or json "
        "with -o json and -o yaml; the pod's CACHEMGR_LOG_FORMAT is for run, warm and probe only)",
    )


def add_progress(parser: argparse.ArgumentParser) -> None:
    duration_option(
        parser,
        "--progress-interval",
        help="log progress (compile_progress, waiting_for_compile, verify_progress...) at most this often "
        "[env CACHEMGR_PROGRESS_INTERVAL; default 30s]",
    )


def add_root(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--cache-root",
        default=env("CACHEMGR_CACHE_ROOT"),
        metavar="DIR",
        help="where the role's compile cache volume is mounted [env CACHEMGR_CACHE_ROOT]",
    )


_OUTPUT_HELP = {
    "table": "aligned columns fitted to the terminal (80 columns without a terminal)",
    "wide": "every column, nothing shortened",
    "json": "the result as JSON",
    "yaml": "the result as YAML",
    "name": "KIND/NAME lines",
    "jsonpath=TEMPLATE": "kubectl's JSONPath template, e.g. jsonpath='{.items[*].key}'",
    "custom-columns=SPEC": "kubectl's columns, e.g. custom-columns=KEY:.key,STATUS:.status",
}


class OutputForm:
    """``-o``'s value: one of ``forms``, or ``jsonpath=``/``custom-columns=`` with their text (a
    usage error names the forms); the template is checked when it is used. ``forms`` is what
    ``cachemgr completion`` offers after ``-o`` (``jsonpath=`` for ``jsonpath=TEMPLATE``)."""

    def __init__(self, forms: tuple[str, ...]) -> None:
        self.forms = forms

    def candidates(self) -> list[str]:
        return [form.partition("=")[0] + "=" if "=" in form else form for form in self.forms]

    def __call__(self, text: str) -> str:
        forms = self.forms
        form, eq, template = text.partition("=")
        if form in forms and not eq:
            return text
        if eq and f"{form}=" in {f.partition("=")[0] + "=" for f in forms if "=" in f}:
            if not template.strip():
                what = (
                    "a template, e.g. jsonpath='{.items[*].key}'"
                    if form == "jsonpath"
                    else ("columns, e.g. custom-columns=KEY:.key,STATUS:.status")
                )
                raise argparse.ArgumentTypeError(f"-o {form}= needs {what}")
            return text
        shown = ", ".join(f.partition("=")[0] + ("=..." if "=" in f else "") for f in forms)
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not an output format ({shown})")


def add_output(parser: argparse.ArgumentParser, *forms: str, sort: bool = False) -> None:
    """``-o`` with the forms this command has (a command with ``json`` takes ``jsonpath=`` and
    ``custom-columns=`` too); tables also take ``--no-headers``; lists with ``sort`` ``--sort-by``."""
    forms = forms or ("table", "wide", "json", "yaml", "name")
    if "json" in forms:
        forms = (*forms, "jsonpath=TEMPLATE", "custom-columns=SPEC")
    parser.add_argument(
        "-o",
        "--output",
        type=OutputForm(forms),
        default="table",
        metavar="FORMAT",
        help="output format: " + "; ".join(f"{f}: {_OUTPUT_HELP[f]}" for f in forms),
    )
    parser.add_argument(
        "--no-headers", action="store_true", help="table rows only: no headers, titles or notes (for scripts)"
    )
    if sort:
        parser.add_argument(
            "--sort-by",
            default=None,
            metavar="JSONPATH",
            help="rows (and -o json items) in the order of this field of each item, e.g. --sort-by .size_bytes",
        )


def add_identity(group: Any) -> None:
    """This image's compiler and NPU: the key's inputs, and what inspection judges entries by."""
    group.add_argument(
        "--compiler-version",
        default=env("CACHEMGR_COMPILER_VERSION"),
        metavar="VERSION",
        help="this image's RBLN Compiler version; default: the installed rebel-compiler "
        "[env CACHEMGR_COMPILER_VERSION]",
    )
    group.add_argument(
        "--npu-type",
        default=env("CACHEMGR_NPU_TYPE"),
        metavar="TYPE",
        help="this pod's NPU type, e.g. RBLN-CA25; default: the device, else RBLN_FORCE_NPU_NAME "
        "[env CACHEMGR_NPU_TYPE]",
    )


def add_key(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("cache key")
    group.add_argument(
        "--role", default=env("CACHEMGR_ROLE"), metavar="ROLE", help="prefill or decode [env CACHEMGR_ROLE]"
    )
    add_identity(group)
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


def add_run(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("run")
    group.add_argument(
        "--state-dir",
        default=env("CACHEMGR_STATE_DIR"),
        metavar="DIR",
        help="pod-local state for the probes [env CACHEMGR_STATE_DIR; default /tmp/cachemgr-state]",
    )
    group.add_argument(
        "--on-miss",
        choices=["compile", "fail"],
        default="compile",
        help="on a miss, compile (default) or fail with exit 69 (pods that rely on a warm Job)",
    )
    duration_option(
        group,
        "--lease-duration",
        default=f"{DEFAULT_LEASE_DURATION:g}",
        help=f"a silent lease holder is taken over after this long (default {DEFAULT_LEASE_DURATION:g}s)",
    )
    duration_option(
        group, "--lease-heartbeat", help="how often the holder refreshes it (default: a third of the lease)"
    )
    duration_option(
        group,
        "--lease-confirm",
        help="hold a won lease this long before compiling, longer than the volume's metadata cache "
        "(default 2s, 0 on a local filesystem) [env CACHEMGR_LEASE_CONFIRM]",
    )
    duration_option(
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
        help="before compiling, remove unused entries of an older compiler version than this image's, never a newer "
        "image's (default off)",
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
    duration_option(
        group,
        "--stall-timeout",
        default="30m",
        help="a compile or load with no CPU, writes or output this long is stalled: liveness fails",
    )
    group.add_argument(
        "--status-port",
        type=port,
        default=None,
        metavar="PORT",
        help="serve /livez /readyz /startupz /status /metrics on this port (0: any free port)",
    )
    group.add_argument(
        "--prefetch",
        choices=["auto", "off"],
        default=env("CACHEMGR_PREFETCH"),
        help="on a hit, read the entry into the page cache while the server initialises "
        "[env CACHEMGR_PREFETCH; default auto]",
    )
    group.add_argument(
        "--on-server-failure",
        nargs="+",
        default=None,
        metavar="POLICY",
        help="'set-aside-after N': once servers exited before ready N times on an entry (any pods), the "
        "next start sets it aside and compiles afresh, once [env CACHEMGR_ON_SERVER_FAILURE; default off]",
    )
    group.add_argument(
        "--remote",
        default=None,
        metavar="URL",
        help="second tier on S3-compatible storage, s3://bucket/prefix: download on a miss, upload after "
        "a compile [env CACHEMGR_REMOTE; endpoint: CACHEMGR_REMOTE_ENDPOINT; default: off]",
    )
    add_signing(group)
    add_trusted(group)


def add_trusted(parser: argparse._ActionsContainer) -> None:  # a parser or one of its groups
    parser.add_argument(
        "--trusted-keys",
        # Unset is the open mode; set, even to "" (an empty ConfigMap key), is a setting to check.
        default=os.environ.get("CACHEMGR_TRUSTED_KEYS"),
        metavar="KEYS",
        help="public keys NAME:BASE64, separated by spaces: use only entries one of them signed "
        "[env CACHEMGR_TRUSTED_KEYS; default: trust every entry]",
    )


def add_signing(parser: argparse._ActionsContainer) -> None:
    parser.add_argument(
        "--signing-key-file",
        default=os.environ.get("CACHEMGR_SIGNING_KEY_FILE"),  # as --trusted-keys: "" is checked
        metavar="FILE",
        help="sign what this pod publishes with this secret key ('cachemgr keys generate') "
        "[env CACHEMGR_SIGNING_KEY_FILE; default: unsigned]",
    )


def add_compat(parser: argparse.ArgumentParser) -> None:
    """Inspection needs this image's compiler to mark incompatible entries, its NPU to tell other NPUs'."""
    add_identity(parser.add_argument_group("this image"))


def add_remote(parser: argparse.ArgumentParser, *, listing: bool = False) -> None:
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
    duration_option(
        parser,
        "--budget",
        help="the most one entry's transfer may take (a pull's listing included): at it the transfer is "
        "abandoned and nothing of it published (push goes on with the next entry) "
        "[default: CACHEMGR_REMOTE_BUDGET, 10m]",
    )
