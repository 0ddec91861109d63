"""The one place where failures become a one-line message, a log event and an exit code.

The Kubernetes termination message (``/dev/termination-log``, or the path in
``CACHEMGR_TERMINATION_LOG``) gets the same line, for ``run`` and ``warm``: ``kubectl
describe pod`` then shows why the container stopped.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Mapping
from pathlib import Path

from cachemgr.core.errors import (
    MESSAGE_LIMIT,
    CacheMgrError,
    ConfigError,
    ExitCode,
    StateDirInUseError,
    shorten,
)
from cachemgr.core.printable import safe

DEFAULT_TERMINATION_LOG = "/dev/termination-log"
_TERMINATION_LIMIT = 4096  # Kubernetes keeps at most 4096 bytes of the message
_RAISED_CHARS = 300  # of each exception the server raised, in the termination message


def exit_code_for(error: BaseException) -> int:
    if isinstance(error, CacheMgrError):
        return error.code
    if isinstance(error, KeyboardInterrupt):
        return 130
    return int(ExitCode.COMPILE_FAILED)


def message_for(error: BaseException) -> str:
    if isinstance(error, CacheMgrError):
        return error.one_line()
    if isinstance(error, KeyboardInterrupt):
        return "interrupted by SIGINT (Ctrl-C) before it finished. Run the command again to finish it."
    return (
        f"internal error: {type(error).__name__}: {shorten(str(error), MESSAGE_LIMIT)}. This is a cachemgr bug: report it with the log above; "
        "the cache itself is unharmed (published entries are never modified)"
    )


def report(
    error: BaseException,
    *,
    command: str,
    environ: Mapping[str, str],
    entrypoint: bool,
    fmt: str | None = None,
) -> int:
    """Say it once on stderr, write the termination message; return the exit code.

    Once, in the format of everything else the command writes on stderr (``fmt``, decided by
    :func:`cachemgr.cli.main.stderr_format`; None: the pod's default, JSON unless stderr is a
    terminal): in the console format the plain line ``cachemgr COMMAND: what happened. What to
    do.`` (after the traceback of an internal error); in JSON the ``failed`` event alone, whose
    ``message`` is that line (and ``exception`` the traceback). The termination message (run,
    warm) gets the line either way.
    """
    code = exit_code_for(error)
    line = message_for(error)
    internal = not isinstance(error, CacheMgrError | KeyboardInterrupt)
    if not _log(error, command=command, code=code, line=line, fmt=fmt):
        if internal:
            traceback.print_exception(error, file=sys.stderr)
        prefix = f"cachemgr {command}" if command else "cachemgr"
        print(f"{prefix}: {safe(line)}", file=sys.stderr, flush=True)
    # Not for a second run refused in a live pod: the termination message is the live one's.
    if entrypoint and not isinstance(error, StateDirInUseError):
        write_termination_message(_termination_text(error, line), environ=environ)
    return code


def _termination_text(error: BaseException, line: str) -> str:
    """The one line; for a server that failed to start, what it raised where its last lines do not
    show it (the root cause of a real vLLM's failure lies tens of lines above them), then its last
    lines, each escaped (``kubectl describe pod`` shows the message raw)."""
    fields = error.fields if isinstance(error, CacheMgrError) else {}
    tail = [str(t) for t in fields.get("last_lines") or []]
    raised = [str(r) for r in fields.get("raised") or [] if not any(str(r) in t for t in tail)]
    if not tail and not raised:
        return safe(line)
    head = [safe(line)]
    if raised:
        head += ["the server raised:", *(safe(shorten(r, _RAISED_CHARS)) for r in raised)]
    if tail:
        head.append("last lines of the server's output:")
    shown = [safe(t) for t in tail]
    # Kubernetes keeps 4096 bytes: the oldest lines go first, the last ones say why it stopped.
    while shown and len("\n".join([*head, *shown]).encode()) > _TERMINATION_LIMIT:
        shown.pop(0)
    return "\n".join([*head, *shown])


def _log(error: BaseException, *, command: str, code: int, line: str, fmt: str | None) -> bool:
    """Log the ``failed`` event where stderr is a JSON log; True if that said it."""
    from cachemgr.core.log import configure, configured_format, get_logger, release, resolve_format

    try:
        wanted = resolve_format(fmt)
    except ConfigError:  # a CACHEMGR_LOG_FORMAT no format has: its own error, said plainly
        wanted = "console"
    if configured_format() is None:
        configure(wanted)  # the command failed before it chose (a usage error, a probe)
    release()  # events held by a run that failed early come first
    if configured_format() != "json":
        return False  # a person reads this stream: the plain line says it all
    fields = dict(error.fields) if isinstance(error, CacheMgrError) else {}
    if not isinstance(error, CacheMgrError | KeyboardInterrupt):
        fields["exception"] = "".join(traceback.format_exception(error))
    reason = (
        error.reason
        if isinstance(error, CacheMgrError)
        else "interrupted"
        if isinstance(error, KeyboardInterrupt)
        else "internal"
    )
    get_logger("cachemgr").error(
        "failed",
        command=command or None,
        exit_code=code,
        reason=reason,
        message=line,
        **{k: v for k, v in fields.items() if k not in {"command", "exit_code", "reason", "message"}},
    )
    return True


def write_termination_message(line: str, *, environ: Mapping[str, str]) -> None:
    """Best effort: outside Kubernetes the default path usually does not exist."""
    path = Path(environ.get("CACHEMGR_TERMINATION_LOG") or DEFAULT_TERMINATION_LOG)
    if not path.parent.is_dir() or (not path.exists() and path == Path(DEFAULT_TERMINATION_LOG)):
        return
    data = line.encode()[:_TERMINATION_LIMIT]
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    except OSError:
        return
    try:
        os.write(fd, data)
    except OSError:
        pass
    finally:
        os.close(fd)
