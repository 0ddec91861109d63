"""The child process a remote transfer runs in: ``python -m cachemgr.remote.worker``.

The parent (:mod:`cachemgr.remote.bounded`: a pod, or ``push``/``pull``) writes one JSON request
line on stdin and keeps stdin open; this process runs the transfer
(:class:`cachemgr.remote.transfer.Remote`, unchanged) and writes JSON lines on stdout:
``planned`` (files and bytes, once known), ``moved`` (bytes so far, a few times a second), then
``done`` or ``error`` (a listing, op ``list``, only the last). It holds no deadline of its own:
the parent kills it at the budget or on a signal. stdin's end means the parent is gone: this
process exits at once, so no orphan keeps a connection to the store or writes into staging.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from cachemgr.core.fsutil import is_disk_full
from cachemgr.remote.config import RemoteConfig, redact
from cachemgr.remote.layout import WireKey
from cachemgr.volume.manifest import Manifest

if TYPE_CHECKING:
    from cachemgr.remote.transfer import Moved, Remote

_EVERY = 0.25  # seconds between progress lines: enough for "what was left", little traffic


class Reporter:
    """Lines to the pod, from the transfer threads too: one lock, progress at most every 250 ms."""

    def __init__(self, out: IO[str]) -> None:
        self._out = out
        self._lock = threading.Lock()
        self._moved = 0
        self._sent_at = 0.0

    def send(self, **line: Any) -> None:
        with self._lock:
            self._out.write(json.dumps(line) + "\n")
            self._out.flush()

    def planned(self, files: int, nbytes: int) -> None:
        self.send(planned={"files": files, "bytes": nbytes})

    def moved(self, nbytes: int) -> None:
        """From s3transfer's threads: the running total, sent at most every 250 ms."""
        with self._lock:
            self._moved += nbytes
            now = time.monotonic()
            if now - self._sent_at < _EVERY:
                return
            self._sent_at = now
            total = self._moved
        self.send(moved=total)


def _download(request: dict[str, Any], remote: Remote, report: Reporter) -> dict[str, Any] | None:
    raw: list[bytes] = []

    def checked(manifest_raw: bytes, manifest: Manifest) -> None:
        raw.append(manifest_raw)  # as checked: what the pod publishes by, never re-read from staging
        report.planned(len(manifest.files), manifest.total_bytes)

    key = WireKey(**request["key"])
    staging = Path(request["staging"])
    result = remote.download(
        key, staging, within=Path(request["within"]), progress=report.moved, on_manifest=checked
    )
    if result is None:
        return None
    return {"manifest": base64.b64encode(raw[0]).decode(), "moved": _moved(result[1])}


def _upload(request: dict[str, Any], remote: Remote, report: Reporter) -> dict[str, Any]:
    moved = remote.upload(
        Path(request["entry"]),
        within=Path(request["within"]),
        uploaded_by=request["uploaded_by"],
        force=bool(request["force"]),
        progress=report.moved,
        planned=report.planned,
    )
    return {"moved": _moved(moved)}


def _list(remote: Remote) -> dict[str, Any]:
    from cachemgr.remote.ops import list_remote, listing_to_wire

    return listing_to_wire(list_remote(remote))


def _moved(moved: Moved) -> dict[str, Any]:
    """As the pod rebuilds it (``Moved(**doc)``): every field, none spelled out."""
    return dataclasses.asdict(moved)


def error_line(error: BaseException, config: RemoteConfig, *, doing: str) -> dict[str, Any]:
    """An exception as the pod rebuilds it: a full disk stays an OSError, the rest one RemoteError."""
    from cachemgr.remote.client import describe

    if isinstance(error, OSError) and is_disk_full(error):
        return {
            "kind": "OSError",
            "errno": error.errno,
            "strerror": error.strerror,
            "filename": error.filename,
        }
    reported = describe(error, config, doing=doing)
    fields = {k: v for k, v in reported.fields.items() if isinstance(v, str | int | float | bool | None)}
    return {
        "kind": type(reported).__name__,
        "what": reported.what,
        "remedy": reported.remedy,
        "fields": fields,
    }


def _exit_when_orphaned(stdin: IO[bytes]) -> None:
    """The pod keeps our stdin open; its end (the pod died, even by SIGKILL) ends us too."""
    stdin.read()
    os._exit(70)


def main() -> int:
    # stdout carries the protocol alone: whatever else prints (a library's warning) goes to stderr.
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    report = Reporter(out)
    request = json.loads(sys.stdin.buffer.readline())
    threading.Thread(target=_exit_when_orphaned, args=(sys.stdin.buffer,), daemon=True).start()
    config = RemoteConfig(**request["config"])
    try:
        from cachemgr.remote.transfer import Remote

        remote = Remote(config)
        op = request["op"]
        done = (
            _download(request, remote, report)
            if op == "download"
            else _list(remote)
            if op == "list"
            else _upload(request, remote, report)
        )
    except BaseException as error:  # noqa: BLE001  # every failure goes to the pod, which decides
        try:
            line = error_line(error, config, doing=request["doing"])
        except Exception as unsaid:  # noqa: BLE001  # describing it failed too: say both, plainly
            what = redact(f"{error!r} ({unsaid!r})", os.environ)[:600]
            line = {"kind": "RemoteError", "what": what, "remedy": "report it"}
        report.send(error=line)
        return 1
    report.send(done=done)
    return 0


if __name__ == "__main__":
    sys.exit(main())
