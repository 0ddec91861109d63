"""A pod's remote transfer in a child process it kills at the budget or on SIGTERM.

``CACHEMGR_REMOTE_BUDGET`` is one deadline for the whole remote attempt: the manifest GET, every
object, every retry. It cannot be a socket timeout: botocore's read timeout fires only when no
byte arrives, so a store (or a proxy, a degraded gateway) that sends one byte every half second
never trips it, and s3transfer's threads are joined at interpreter exit, so a read that never
ends holds even a stopping process. Nor can it be a thread the pod gives up on: botocore does not
expose the sockets of a request in flight, and a thread cannot be stopped from outside.

So the transfer runs in a child (``python -m cachemgr.remote.worker``): :class:`Remote`'s own
code, unchanged, reporting what it planned and moved on a pipe. The pod waits for it, watching
the deadline and its stop flag; at either it kills the child (SIGKILL, certain): the kernel
closes its connections, no thread of it writes on, and the caller removes the partial files
(the download's staging). Only the remote tier pays for the child (a Python start, ~0.3 s of
the budget), on a local miss or after a compile; a hit never reaches this module.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachemgr.core import procs
from cachemgr.core.units import human_bytes, plural
from cachemgr.remote import client
from cachemgr.remote.config import ENV_BUDGET, RemoteConfig

if TYPE_CHECKING:
    from collections.abc import Mapping

    from cachemgr.key.cachekey import CacheKey
    from cachemgr.remote.transfer import Moved, Progress, StopFlag
    from cachemgr.volume.manifest import Manifest

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # holds cachemgr/: the child imports this copy
_STDERR_TAIL = 2000
_ERRORS: dict[str, type[client.RemoteError]] = {
    cls.__name__: cls
    for cls in (
        client.RemoteError,
        client.RemoteDamageError,
        client.RemoteUntrustedError,
        client.RemoteFullError,
    )
}


class BoundedRemote:
    """:class:`cachemgr.remote.transfer.Remote`'s ``download`` and ``upload``, each in a child
    process that ends at ``deadline`` or when ``stop`` is set, whatever the store does."""

    def __init__(self, config: RemoteConfig, *, budget_name: str = ENV_BUDGET) -> None:
        """``budget_name``: what the budget's line names (a pod's variable; ``push``'s ``--budget``)."""
        self.config = config
        self.budget_name = budget_name

    def download(
        self,
        key: CacheKey,
        staging: Path,
        *,
        within: Path,
        deadline: float | None,
        stop: StopFlag | None = None,
        progress: Progress | None = None,
    ) -> tuple[Manifest, Moved] | None:
        """As Remote.download; TimeoutError-like RemoteError (problem ``budget``) at the deadline,
        InterruptedError on stop. The caller removes ``staging`` in every case but success."""
        from cachemgr.remote.layout import checked_manifest

        request = {
            "op": "download",
            "key": {"digest": key.digest, "inputs": dict(key.inputs), "entry_name": key.entry_name},
            "staging": str(staging),
            "within": str(within),
            "doing": f"downloading key {key.short}",
        }
        child = _Child(self.config, request, progress=progress, budget_name=self.budget_name)
        done = child.run(deadline=deadline, stop=stop, what=f"entry {key.entry_name}", verb="deliver")
        if done is None:
            return None
        manifest, _ = checked_manifest(base64.b64decode(done["manifest"]), staging, key)
        return manifest, _moved(done["moved"])

    def upload(
        self,
        entry_dir: Path,
        *,
        within: Path,
        uploaded_by: Mapping[str, Any],
        deadline: float | None,
        stop: StopFlag | None = None,
        force: bool = False,
    ) -> Moved:
        """As Remote.upload, ended at ``deadline`` or on ``stop``: no manifest goes up then."""
        request = {
            "op": "upload",
            "entry": str(entry_dir),
            "within": str(within),
            "uploaded_by": dict(uploaded_by),
            "force": force,
            "doing": f"uploading {entry_dir.name}",
        }
        done = _Child(self.config, request, budget_name=self.budget_name).run(
            deadline=deadline, stop=stop, what=f"the upload of {entry_dir.name}", verb="finish"
        )
        assert done is not None  # an upload always reports what it moved
        return _moved(done["moved"])

    def listing(self, *, deadline: float | None, stop: StopFlag | None = None) -> dict[str, Any]:
        """:func:`cachemgr.remote.ops.list_remote`'s listing as the child sends it (read back by
        ``ops.listing_from_wire``), ended at ``deadline`` or on ``stop``: a listing is small, but a
        store that trickles it holds its reads as it holds a download's."""
        request = {"op": "list", "doing": "listing"}
        done = _Child(self.config, request, budget_name=self.budget_name).run(
            deadline=deadline, stop=stop, what="the listing of its entries", verb="finish"
        )
        assert isinstance(done, dict)  # a listing always reports one
        return done


class _Child:
    """One worker process: its request, what it reported, and how it ended."""

    def __init__(
        self,
        config: RemoteConfig,
        request: dict[str, Any],
        *,
        progress: Progress | None = None,
        budget_name: str = ENV_BUDGET,
    ) -> None:
        self.config = config
        self.budget_name = budget_name
        self.request = {**request, "config": _config_doc(config)}
        self.progress = progress
        self.planned: dict[str, int] | None = None
        self.moved = 0
        self.outcome: dict[str, Any] | None = None

    def run(self, *, deadline: float | None, stop: StopFlag | None, what: str, verb: str) -> Any:
        """The child's ``done`` value; raises its error, the budget's, or InterruptedError."""
        with tempfile.TemporaryFile() as errors:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "cachemgr.remote.worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                env=_child_env(),
                close_fds=True,
            )
            procs.add_helper(proc.pid)
            reader = threading.Thread(
                target=self._read, args=(proc,), name="cachemgr-remote-lines", daemon=True
            )
            try:
                assert proc.stdin is not None
                with contextlib.suppress(BrokenPipeError):  # it died at once: its code and stderr say why
                    proc.stdin.write(json.dumps(self.request).encode() + b"\n")
                    proc.stdin.flush()
                reader.start()
                self._wait(proc, deadline=deadline, stop=stop, what=what, verb=verb)
            finally:
                if proc.poll() is None:
                    proc.kill()  # SIGKILL: its sockets close with it, none of its threads writes on
                proc.wait()
                procs.discard_helper(proc.pid)
                reader.join(timeout=5)
                for pipe in (proc.stdin, proc.stdout):
                    with contextlib.suppress(OSError):
                        pipe.close()  # type: ignore[union-attr]  # both are pipes (PIPE above)
            return self._result(proc.returncode, errors, stop=stop)

    def _wait(
        self,
        proc: subprocess.Popen[bytes],
        *,
        deadline: float | None,
        stop: StopFlag | None,
        what: str,
        verb: str,
    ) -> None:
        while proc.poll() is None:
            if stop is not None and stop.is_set():
                raise InterruptedError("stopped")
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise self._over_budget(what=what, verb=verb)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.05 if left is None else min(0.05, left))

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue  # not ours: the protocol is one JSON object per line
            if "moved" in line and isinstance(line["moved"], int):
                if line["moved"] > self.moved:  # two transfer threads may send out of order
                    if self.progress is not None:
                        self.progress(line["moved"] - self.moved)
                    self.moved = line["moved"]
            elif "planned" in line:
                self.planned = line["planned"]
            elif "done" in line or "error" in line:
                self.outcome = line

    def _result(self, code: int, errors: Any, *, stop: StopFlag | None) -> Any:
        # The outcome line, written before the child exits, decides; not its exit code: a pod that
        # is PID 1 or a subreaper reaps every orphan while its server runs (launcher.wait_reaping)
        # and may reap an upload's child first (Popen then reads code 0).
        outcome = self.outcome
        if outcome is not None and "done" in outcome:
            return outcome["done"]
        if outcome is not None:
            raise _rebuilt(outcome["error"])
        if stop is not None and stop.is_set():
            raise InterruptedError("stopped")  # the signal reached the child too (a process group's)
        errors.seek(0, os.SEEK_END)
        errors.seek(max(0, errors.tell() - _STDERR_TAIL))
        tail = errors.read().decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise client.RemoteError(
            f"the remote transfer's process ended with code {code} ({tail[0][:300]})",
            remedy="a cachemgr bug, or the pod's memory limit: report it; this pod compiles meanwhile",
            problem="worker",
        )

    def _over_budget(self, *, what: str, verb: str) -> client.RemoteError:
        where = self.config.url + (f" at {self.config.endpoint}" if self.config.endpoint else "")
        op = self.request["op"]
        if self.planned is None:
            left = _NOTHING_YET[op]
        else:
            done = "arrived" if op == "download" else "gone up"
            left = (
                f"{human_bytes(self.moved)} of the {human_bytes(self.planned['bytes'])} of its "
                f"{plural(int(self.planned['files']), 'file')} had {done}"
            )
        budget = f"{self.budget_name}={self.config.budget:g}s"
        return client.RemoteError(
            f"remote {where} did not {verb} {what} within {budget}: {left}; {_ABANDONED[op]}",
            remedy=f"check the store's throughput and the network path to it (a slow gateway or proxy), or raise {self.budget_name}",
            problem="budget",
            budget_s=self.config.budget,
            moved_bytes=self.moved,
        )


_NOTHING_YET = {
    "download": "its manifest had not arrived",
    "upload": "nothing was sent yet",
    "list": "the listing had not arrived whole",
}
_ABANDONED = {
    "download": "the transfer was abandoned and its partial files removed",
    "upload": "the upload was abandoned before its manifest, so no reader takes it",
    "list": "the listing was abandoned",
}


def _rebuilt(error: dict[str, Any]) -> BaseException:
    """The child's failure as it was there: an OSError for a full disk, else its RemoteError."""
    if error.get("kind") == "OSError":
        return OSError(error.get("errno"), error.get("strerror"), error.get("filename"))
    cls = _ERRORS.get(str(error.get("kind")), client.RemoteError)
    return cls(str(error.get("what")), remedy=str(error.get("remedy")), **dict(error.get("fields") or {}))


def _moved(doc: dict[str, Any]) -> Moved:
    from cachemgr.remote.transfer import Moved

    return Moved(**doc)


def _config_doc(config: RemoteConfig) -> dict[str, Any]:
    """The config as the child rebuilds it (``RemoteConfig(**doc)``): every field, none spelled out."""
    return dict(config._asdict())


def _child_env() -> dict[str, str]:
    """This environment (the AWS chain reads it), with this cachemgr first on the import path."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
    return env
