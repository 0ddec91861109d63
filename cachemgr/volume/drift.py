"""``recompiled_on_hit``: the alarm for a key that misses something the server hashes.

A hit is worth something only if the server then loads instead of compiling. On a hit with the
``vllm`` strategy the server's ``VLLM_CACHE_ROOT`` is a pod-local view of the entry, so what it
writes lands there, where it can be seen. New compiled artifacts mean the server did not find
what cachemgr promised it: its own key (vllm-rbln's optimum directory name or bundle signature)
differs from the entry's, because of an input cachemgr does not key on. That is reported once
per new path, as a warning event, a Prometheus counter and a record beside the entry that
``ls``, ``show`` and ``explain`` read; the server keeps running.

What counts, from vllm-rbln 0.12's code:

- a new file under ``compiled_models/``: the optimum path compiled a directory of its own
  (``utils/optimum/converter/dispatch.py`` 114-125, ``models/optimum/model_base.py`` 273);
- a new ``rbln/**/mega_cache.bin``: a bundle under another model directory or signature
  (``v1/worker/mega_cache.py`` 161-174).

- a bundle (or compiled file) the server re-saved at the entry's own path, larger than published:
  when it finds graphs missing from a bundle it loaded, it compiles them and saves the bundle again
  (``mega_cache.save`` after warm-up, tmp file + rename onto the same path, ``mega_cache.py``
  206-227), which replaces the view's link by a file of its own, with more graphs in it.

What is not the alarm but said apart (``resaved_on_hit``, an info event with its own counter): a
re-save of the published size with other bytes, or smaller. It means more graphs only if rebel's
bundle is byte-stable (the same graphs always written as the same bytes), which nothing here can
show; until it is shown, a writer that orders or stamps its bundle differently on each save must
not make every hit an alarm. Growth and new paths stay the alarm.

What is neither: the re-save of the same bundle after every warm-up (the same bytes as published),
anything named ``*.tmp`` on its way to a rename, and vLLM's model-info records under ``modelinfos/``
(vLLM ``model_executor/models/registry.py`` 963).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from cachemgr.core import coerce, jsonread, safefs, safewalk
from cachemgr.core.fsutil import atomic_write_json, hash_file
from cachemgr.volume.manifest import ARTIFACTS, FileRecord, Manifest
from cachemgr.volume.records import RECOMPILED_PREFIX

if TYPE_CHECKING:
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import CacheRoot

EVENT = "recompiled_on_hit"
RESAVED_EVENT = "resaved_on_hit"
# Beside the entry's use records (usage/<digest>/), one per pod start that saw it; not *.json,
# so it is never read as a use record, and prune drops it with the entry's other bookkeeping.
RECORD_PREFIX = RECOMPILED_PREFIX  # one name, kept in cachemgr.volume.records
_SHOWN = 20  # paths named in the log line and the record; the count says how many in all
# How vllm-rbln lays compiled artifacts out (cachemgr.key.release_model.Layout): "optimum_dir"
# (compiled_models/<name>/) and "bundle" (rbln/**/mega_cache.bin). A key's release says which its model
# paths use (key.details["layouts"]); both, where it does not say.
LAYOUTS: tuple[str, ...] = ("bundle", "optimum_dir")
_POLL = 0.5
_RECORD_MAX = 1 << 20  # a record names at most _SHOWN paths: one larger was planted


class Drift(NamedTuple):
    """What a hit's server wrote into its view (paths relative to it, a re-saved one with what changed)."""

    compiled: list[str]  # the alarm: new compiled artifacts, or a bundle re-saved larger
    resaved: list[str]  # said apart: re-saved with other bytes of the same size, or smaller


def new_artifacts(
    view: Path,
    manifest: Manifest,
    memo: dict[tuple[str, int, int], str] | None = None,
    *,
    deep: bool = True,
    layouts: tuple[str, ...] = LAYOUTS,
) -> Drift:
    """Compiled artifacts in ``view`` that the entry does not hold, and those the server re-saved;
    compiled artifacts are those of ``layouts`` (the key's release's, for its model paths)."""
    cut = len(ARTIFACTS) + 1
    known = {
        record.path[cut:]: record for record in manifest.files if record.path.startswith(ARTIFACTS + "/")
    }
    compiled: list[str] = []
    resaved: list[str] = []
    # The one walk (a few descriptors however deep the server's tree, never a link followed);
    # vLLM's modelinfos/ is not the compile's.
    with safefs.open_tree(view, within=None) as top:
        for rel, item, _ in safewalk.walk(top, enter=lambda rel: rel != "modelinfos"):
            if item.is_dir(follow_symlinks=False) or not _is_compiled(rel, layouts):
                continue
            if rel not in known:
                compiled.append(rel)
            elif (
                change := _resaved(view / rel, known[rel], {} if memo is None else memo, deep=deep)
            ) is not None:
                grown, what = change
                (compiled if grown else resaved).append(f"{rel} ({what})")
    return Drift(sorted(compiled), sorted(resaved))


def _resaved(
    path: Path, record: FileRecord, memo: dict[tuple[str, int, int], str], *, deep: bool
) -> tuple[bool, str] | None:
    """Whether the server grew the file it replaced the view's link to ``record`` with, and what changed."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None  # still the view's link to the entry: untouched
    if st.st_size != record.size:
        grown = st.st_size > record.size
        return (
            grown,
            f"re-saved {'larger' if grown else 'smaller'} than published: {record.size} -> {st.st_size} bytes",
        )
    ident = (str(path), st.st_size, st.st_mtime_ns)
    if record.xxh3 and ident not in memo and deep:
        with contextlib.suppress(OSError):
            memo[ident] = hash_file(path)
    if memo.get(ident, record.xxh3) == record.xxh3:
        return None  # the bytes it was published with (or not hashed: no time at exit, or unreadable)
    return False, f"re-saved with other content, same size ({st.st_size} bytes)"


def _is_compiled(rel: str, layouts: tuple[str, ...]) -> bool:
    parts = rel.split("/")
    if any(part.endswith(".tmp") for part in parts):
        return False
    if parts[0] == "compiled_models":
        return len(parts) > 1 and "optimum_dir" in layouts
    return parts[0] == "rbln" and parts[-1] == "mega_cache.bin" and "bundle" in layouts


class DriftWatch:
    """Looks at the view once the server is serving, and once more when it exits."""

    def __init__(
        self,
        view: Path,
        manifest: Manifest,
        *,
        report: Callable[[list[str]], None],
        note: Callable[[list[str]], None] | None = None,
        layouts: tuple[str, ...] = LAYOUTS,
    ) -> None:
        self._view = view
        self._layouts = layouts
        self._manifest = manifest
        self._report = report
        self._note = note
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._hashes: dict[tuple[str, int, int], str] = {}  # a re-saved file is hashed once
        self._exited: threading.Event | None = None

    def check(self) -> list[str]:
        """Report the paths not reported before; return them.

        Once the server has exited (the last look, as the pod stops) a re-saved file of the
        published size is not hashed: SIGTERM's grace period is no time to read gigabytes.
        """
        deep = self._exited is None or not self._exited.is_set()
        with self._lock:
            found = new_artifacts(self._view, self._manifest, self._hashes, deep=deep, layouts=self._layouts)
            new = [p for p in found.compiled if p not in self._seen]
            noted = [p for p in found.resaved if p not in self._seen]
            self._seen.update(new, noted)
        if new:
            self._report(new)
        if noted and self._note is not None:
            self._note(noted)
        return new

    def start(self, *, serving: Callable[[], bool], exited: threading.Event) -> None:
        """In the background: check when the server first serves (warm-up, and any save, is done)."""

        self._exited = exited

        def watch() -> None:
            while not exited.is_set():
                if serving():
                    self.check()
                    return
                exited.wait(_POLL)

        threading.Thread(target=watch, name="cachemgr-drift", daemon=True).start()


def record(root: CacheRoot, digest: str, identity: PodIdentity, *, entry: str, paths: list[str]) -> None:
    """Keep the event beside the entry (best effort: the hit path may have no write access)."""
    folder = root.usage / digest
    target = folder / f"{RECORD_PREFIX}{identity.file_stem}"
    previous: Any = None
    with contextlib.suppress(OSError, ValueError):
        previous = jsonread.read(target)
    merged = sorted(set(_checked(previous)["paths"]) | set(paths))
    with contextlib.suppress(OSError):  # VolumeError (a planted symlink) is an OSError too
        safefs.make_dirs(root.path, folder)  # a symlink planted as usage/<digest> is refused
        atomic_write_json(
            target,
            {
                "event": EVENT,
                "entry": entry,
                "key": digest,
                "pod": identity.pod,
                "node": identity.node,
                "time": time.time(),
                "count": len(merged),
                "paths": merged[:_SHOWN],
            },
            within=root.path,
        )


def records(root: CacheRoot, digest: str) -> list[dict[str, Any]]:
    """Every ``recompiled_on_hit`` record of a key, oldest first."""
    folder = root.usage / digest
    try:
        names = [n for n in safefs.listdir(root.path, folder) if n.startswith(RECORD_PREFIX)]
    except OSError:  # a symlink planted as usage/<digest>: no records to show from it
        return []
    found = []
    with contextlib.suppress(OSError), safefs.open_dir(root.path, folder) as fd:
        for name in names:
            with contextlib.suppress(OSError, ValueError):
                found.append(_checked(jsonread.read_object(name, dir_fd=fd, limit=_RECORD_MAX)))
    return sorted(found, key=lambda r: r["time"])


def _checked(doc: Any) -> dict[str, Any]:
    """A record as :func:`record` writes it, each field of its type (anyone writes ``usage/``)."""
    data = doc if isinstance(doc, dict) else {}
    paths = data.get("paths")
    count = data.get("count")
    return {
        "event": EVENT,
        "entry": coerce.text(data.get("entry")),
        "key": coerce.text(data.get("key")),
        "pod": coerce.text(data.get("pod")),
        "node": coerce.text(data.get("node")),
        "time": coerce.number(data.get("time")) or 0.0,
        "count": count if isinstance(count, int) and not isinstance(count, bool) and count >= 0 else 0,
        "paths": [p for p in paths if isinstance(p, str)][:_SHOWN] if isinstance(paths, list) else [],
    }


def shown(paths: list[str]) -> list[str]:
    return paths[:_SHOWN]
