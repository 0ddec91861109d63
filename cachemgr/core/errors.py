"""Every failure cachemgr reports: what happened, what to do, and its exit code.

Exit codes follow sysexits(3), as in docs/design.md's interface contract. Each exception
subclasses the builtin it is a kind of (``TimeoutError``, ``OSError``...), so library
callers can catch it as such, and carries a one-line message: what happened, then the
remedy. :attr:`CacheMgrError.code` is the one place that maps an error to the process's exit
code (the CLI's report and the run's state record both read it).
"""

from __future__ import annotations

import enum
from typing import Any


class ExitCode(enum.IntEnum):
    """The documented exit codes; any other code is the server's own."""

    OK = 0
    NOT_A_HIT = 1  # explain: no entry this argv would load (a miss; damaged, untrusted), as diff's 1
    USAGE = 64  # EX_USAGE: bad flags or arguments
    NOT_FOUND = 66  # EX_NOINPUT: no entry (or record) matches the KEY an inspection command was given
    MISS = 69  # EX_UNAVAILABLE: no published entry and --on-miss fail
    COMPILE_FAILED = 70  # EX_SOFTWARE: the compiler (or the server while compiling) failed
    DISK_FULL = 73  # EX_CANTCREAT: the volume is full or the quota is exceeded
    VOLUME = 74  # EX_IOERR: the cache volume cannot be used
    WAIT_TIMEOUT = 75  # EX_TEMPFAIL: gave up waiting for another pod's compile
    CONFIG = 78  # EX_CONFIG: key inputs undeterminable, or configuration invalid


MESSAGE_LIMIT = 600  # characters of a message's "what" and of its remedy, both at most 900: one readable line


def shorten(text: str, limit: int) -> str:
    """One line of at most about ``limit`` characters: whitespace folded, the middle elided."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    keep = (limit - 5) // 2
    return f"{text[:keep]} ... {text[-keep:]}"


class CacheMgrError(Exception):
    """Base of every reported failure.

    ``what`` says what happened (naming the path or the input), ``remedy`` what to do.
    ``fields`` carry the facts for logs and JSON output.
    """

    exit_code: ExitCode = ExitCode.VOLUME
    reason: str = "error"

    def __init__(self, what: str, *, remedy: str, **fields: Any) -> None:
        self.what = what.rstrip(".")
        self.remedy = remedy.rstrip(".")
        self.fields = fields
        super().__init__(self.one_line())

    @property
    def code(self) -> int:
        """The exit code the process reports for this error."""
        return int(self.exit_code)

    def one_line(self) -> str:
        """The message for logs, stderr and the Kubernetes termination message.

        Capped: a message quotes its input (a path, a model name, a flag's value), and a 100 KB
        input must not make a 100 KB line.
        """
        remedy = shorten(self.remedy[:1].upper() + self.remedy[1:], MESSAGE_LIMIT)
        # The line's room is MESSAGE_LIMIT and a half: a long remedy takes it from the what, whose
        # middle is cut instead (a cut must never fall on what to do, issue 40).
        what = shorten(self.what, max(MESSAGE_LIMIT + MESSAGE_LIMIT // 2 - len(remedy), MESSAGE_LIMIT // 2))
        return f"{what}. {remedy}."

    def __str__(self) -> str:
        return self.one_line()

    def __reduce__(self) -> tuple[Any, ...]:
        # Keep the keyword-only constructor picklable (errors cross process boundaries in tests).
        return (_rebuild, (type(self), self.what, self.remedy, self.fields))


def _rebuild(cls: type[CacheMgrError], what: str, remedy: str, fields: dict[str, Any]) -> CacheMgrError:
    return cls(what, remedy=remedy, **fields)


class UsageError(CacheMgrError, ValueError):
    """A flag or argument is wrong."""

    exit_code = ExitCode.USAGE
    reason = "usage"


class NotFoundError(CacheMgrError, LookupError):
    """Nothing on the volume (or in the remote) matches the KEY a command was given.

    Its own code, not 64: the command was right, the cache does not hold what it names (a script
    can tell "gone" from "mistyped", as ``kubectl get`` tells NotFound from a bad flag).
    """

    exit_code = ExitCode.NOT_FOUND
    reason = "not-found"


class StateDirInUseError(CacheMgrError, RuntimeError):
    """A second ``run`` met a state dir owned by a live ``run`` (``kubectl exec`` inherits it).

    Exit 64 (usage), not 75: waiting or retrying cannot help while the pod serves, and the
    remedy is to invoke it differently (``cachemgr warm``, or another ``--state-dir``). The
    live ``run`` keeps its state record, views and probes untouched.
    """

    exit_code = ExitCode.USAGE
    reason = "state-dir-in-use"


class ConfigError(CacheMgrError, ValueError):
    """Configuration is invalid, or a key input cannot be determined (fail closed)."""

    exit_code = ExitCode.CONFIG
    reason = "config"


class MissError(CacheMgrError, LookupError):
    """No published entry matches and this pod must not compile (--on-miss fail)."""

    exit_code = ExitCode.MISS
    reason = "miss"


class CompileError(CacheMgrError, RuntimeError):
    """The compile step failed; nothing was published."""

    exit_code = ExitCode.COMPILE_FAILED
    reason = "compile-failed"


class DiskFullError(CacheMgrError, OSError):
    """The cache volume is full or its quota is exceeded."""

    exit_code = ExitCode.DISK_FULL
    reason = "disk-full"


class VolumeError(CacheMgrError, OSError):
    """The cache volume cannot be used (missing, read-only, newer layout, I/O errors)."""

    exit_code = ExitCode.VOLUME
    reason = "volume"


class WaitTimeoutError(CacheMgrError, TimeoutError):
    """Gave up waiting for another pod to publish (--wait-timeout)."""

    exit_code = ExitCode.WAIT_TIMEOUT
    reason = "wait-timeout"


class ServerFailedError(CacheMgrError, ChildProcessError):
    """The server exited before it was ready, on an entry found in the cache.

    The run ends with the server's own exit code (128+N when signal N killed it), as when it
    stops later; ``last_lines`` is the end of its output, for the log event and the Kubernetes
    termination message.
    """

    reason = "server-failed"

    @property
    def code(self) -> int:
        return int(self.fields["exit_status"])


def _signal_name(signum: int) -> str:
    import signal

    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class Interrupted(CacheMgrError):  # noqa: N818  # a clean stop, reported by its exit code, not a fault
    """A termination signal arrived before the server started; everything was cleaned up."""

    reason = "interrupted"

    def __init__(
        self,
        signum: int,
        *,
        server_compiling: bool = False,
        during: str | None = None,
        remedy: str = "nothing to do: the next start resumes from the shared cache",
    ) -> None:
        """``during``: what a command other than ``run`` was doing and left behind (``push``,
        ``pull``: "while pulling entry E; ..."), said after the signal's number and name."""
        self.signum = signum
        what = (
            f"stopped by signal {signum} ({_signal_name(signum)}) {during}"
            if during
            else f"stopped by signal {signum} while the server compiled ({_signal_name(signum)}); the server was "
            "stopped before it served, nothing was published, and the compile's staging and lease are cleaned up"
            if server_compiling
            else f"stopped by signal {signum} before the server started ({_signal_name(signum)}); no server was "
            "started, and what this pod had begun on the volume, if anything (a compile's staging, a lease), "
            "is cleaned up"
        )
        super().__init__(what, remedy=remedy, signum=signum)

    @property
    def code(self) -> int:
        """128+N, as a shell reports a process killed by signal N."""
        return 128 + self.signum
