"""How a key compiles, and how its server is pointed at an entry: one strategy object per way.

The runner (cachemgr.runtime.runner) takes a :class:`Strategy` and calls the same methods
whatever the key's strategy; the subclasses override what differs, as diskcache's ``JSONDisk``
overrides its ``Disk``.

``command`` (:class:`CommandStrategy`): an operator-given compiler runs before the server,
writing to ``{output_dir}`` (private staging); once it exits 0 the attempt is published and the
server is launched like on any hit; its argv may name ``{artifact_dir}``.

``vllm`` (:class:`VllmStrategy`): vllm-rbln compiles inside the server at start-up and writes
under ``VLLM_CACHE_ROOT`` (``compiled_models/`` on the optimum path, mega-cache bundles under
``rbln/`` on the vLLM-model path). On a miss the server runs with ``VLLM_CACHE_ROOT`` in
staging; once its health endpoint answers, the staging content is published by hard-linking
it into a second attempt directory that is renamed into place, so the running server keeps
its own directory undisturbed, and serves on.

On a hit, either server gets a pod-local view of the entry (cachemgr.runtime.views).
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, NamedTuple

from cachemgr.core import safefs, safewalk
from cachemgr.core.errors import CompileError, ConfigError
from cachemgr.core.fsutil import tree_bytes
from cachemgr.core.log import get_logger
from cachemgr.runtime import failures, launcher
from cachemgr.runtime.health import health_ok

if TYPE_CHECKING:
    import subprocess

    from cachemgr.key.cachekey import CacheKey
    from cachemgr.ops.progress import CompileProgress
    from cachemgr.runtime.pod import Pod
    from cachemgr.volume.drift import DriftWatch
    from cachemgr.volume.layout import CacheRoot
    from cachemgr.volume.lease import KeyLease
    from cachemgr.volume.store import Lookup, Staging

log = get_logger("cachemgr.run")

ARTIFACT_DIR = "{artifact_dir}"
OUTPUT_DIR = "{output_dir}"
_LINK_FALLBACK = frozenset({errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EMLINK, errno.EOPNOTSUPP})


class Compiled(NamedTuple):
    """How a compile under the lease ended, when it did not fail.

    ``exit_code`` None: the flow goes on: with ``found``, to launch that entry at once (it was
    there when the lease was taken, or the remote had it); without, to look again.
    A vllm server that compiled serves on from its own staging, so the run ends with it:
    ``exit_code`` is its exit code (0 for a compile-only server or a warm Job).
    """

    exit_code: int | None = None
    found: Lookup | None = None


class Strategy:
    """One way of compiling a key. The base holds what every compile attempt shares."""

    name: ClassVar[str]

    def __init__(self, pod: Pod) -> None:
        self.pod = pod
        self._progress: CompileProgress | None = None
        self._peak_staged = 0  # the most the last attempt was seen to have staged

    # --- what differs -------------------------------------------------------------------

    def check_can_compile(self, key: CacheKey) -> None:
        """Refuse up front a compile that cannot succeed here (default: any can)."""

    def compile(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> Compiled:
        """Compile into private staging and publish, under ``lease``; raise on failure."""
        raise NotImplementedError

    def server_launch(self, key: CacheKey, view: Path) -> tuple[list[str], dict[str, str]]:
        """The server's argv and environment, pointed at ``view`` of the published entry."""
        raise NotImplementedError

    def watch_hit(self, root: CacheRoot, key: CacheKey, found: Lookup, view: Path) -> DriftWatch | None:
        """Watch a server started on a hit for what the key missed (default: nothing to watch)."""
        return None

    def publish(
        self, root: CacheRoot, key: CacheKey, staging: Staging, lease: KeyLease, *, seconds: float
    ) -> None:
        """Publish the attempt in ``staging`` (the runner's publish: manifest last, one rename)."""
        self.pod.publish(root, key, staging, lease, seconds=seconds)

    # --- what every attempt shares ------------------------------------------------------

    def _start_progress(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> None:
        """compile_progress events and the progress record beside the lease (cachemgr.ops.progress)."""
        from cachemgr.ops.progress import start_compile_progress

        self._progress = start_compile_progress(
            root,
            key,
            token=lease.token,
            pod=self.pod.identity.pod,
            preflight=self.pod.preflight_found,
            interval=self.pod.options.progress_interval,
            bar=self.pod.options.warm,  # a Job run by hand on a terminal; pods log compile_progress
        )
        # For /metrics: the compile's progress and ETA, and what its peers' wait is held to.
        expected = {
            "expected_compile_s": self._progress.expected_seconds,
            "expected_bytes": self._progress.expected_bytes,
        }
        self.pod.state.update(detail={k: v for k, v in expected.items() if v is not None})

    def _stop_progress(self, *, staged: Path | None = None) -> None:
        reporter, self._progress = self._progress, None
        if reporter is not None:
            reporter.close(staged=staged)
            self._peak_staged = reporter.peak_staged

    def _sample(self, monitor: launcher.ProgressMonitor) -> None:
        progress = self.pod.stall.sample(monitor)
        if self._progress is not None:
            self._progress.tick(
                cpu_seconds=progress.cpu_seconds,
                staged_bytes=progress.staging_bytes,
                no_progress_s=self.pod.stall.no_progress_s,
                stall_timeout=self.pod.stall.stall_timeout,
            )

    def _check_loadable(self, key: CacheKey, staging: Staging, *, serving: bool) -> bool:
        """Publish only what the server will load (cachemgr.runtime.loadable): a serving server keeps
        serving unpublished; a compile that is all there is (warm, compile-only) has failed."""
        from cachemgr.runtime.loadable import why_not_loadable

        within = staging.within or self.pod.options.cache_root
        why = why_not_loadable(staging.artifacts, strategy=self.name, layouts=_layouts(key), within=within)
        if why is None:
            return True
        cannot = "; ".join(key.details.get("uncacheable", ())) or "see the server's output"
        if serving:
            log.warning(
                "not_published", key=key.short, reason=why, cause=cannot, note="the server keeps serving"
            )
            return False
        raise CompileError(
            f"{why}; nothing was published ({cannot})",
            remedy="'cachemgr explain -- ARGV' says whether this configuration can be cached at all",
        )

    def _fail_attempt(
        self,
        root: CacheRoot,
        key: CacheKey,
        staging: Staging,
        error: BaseException,
        *,
        watch: launcher.OutputWatch | None,
        started: float,
    ) -> None:
        """Remove the attempt, then record why it failed (after freeing space, so the record fits)."""
        # A compiler may remove its partial output before it exits (optimum-rbln 0.12.0 save_pretrained
        # deletes its .tmp copy on any error, optimum/rbln/modeling_base.py:719-723): the most it was
        # seen to have staged counts too.
        self._stop_progress()
        written = max(tree_bytes(staging.artifacts, within=root.path), self._peak_staged)
        self.pod.beats.discard(staging.owner_file)  # first: no beat writes its record again
        staging.discard()
        found = self.pod.preflight_found
        reported = failures.as_reported(
            error,
            root,
            key,
            given=self.pod.options.expected_size,
            written=written,
            free_at_start=found.space.free_bytes if found is not None else None,
            hook=self.pod.options.hook,
        )
        if reported is None:
            return
        tail = watch.tail_text() if watch is not None else []
        failures.record(
            root,
            key,
            self.pod.identity,
            reported,
            written=written,
            elapsed=time.monotonic() - started,
            tail=tail,
        )
        if reported is not error:
            raise reported from error


class CommandStrategy(Strategy):
    """A compile command writes ``{output_dir}``; then the server is launched like on a hit."""

    name = "command"

    def compile(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> Compiled:
        pod = self.pod
        staging = pod.new_staging(root, key)
        started = time.monotonic()
        watch: launcher.OutputWatch | None = None
        try:
            pod.enter("compiling", strategy=self.name, staging=str(staging.path))
            self._start_progress(root, key, lease)
            with safefs.pinned(root.path, staging.artifacts) as output_dir:
                argv = render(key.inputs["compile_cmd"], output_dir=str(output_dir))
                child = launcher.start(argv, env=pod.environ, capture=True, what="compile command")
                watch = launcher.OutputWatch(child)
                monitor = launcher.ProgressMonitor(
                    child, staging=staging.artifacts, output=watch, within=root.path
                )
                code = launcher.run_until(
                    child,
                    events=[pod.relay.stop, watch.disk_full],
                    every=lambda: self._sample(monitor),
                    tick=0.5,
                )
                if code is None:
                    launcher.terminate_tree(child)
                watch.join()
            failures.compile_ended(code, watch, relay=pod.relay, what="compile command", key=key)
            self._stop_progress(staged=staging.artifacts)
            self._check_loadable(key, staging, serving=False)
            self.publish(root, key, staging, lease, seconds=time.monotonic() - started)
        except BaseException as error:
            self._fail_attempt(root, key, staging, error, watch=watch, started=started)
            raise
        finally:
            self._stop_progress()
            pod.beats.discard(staging.owner_file)
        return Compiled()

    def server_launch(self, key: CacheKey, view: Path) -> tuple[list[str], dict[str, str]]:
        return render(key.server.argv, artifact_dir=str(view)), dict(self.pod.environ)


class VllmStrategy(Strategy):
    """The server compiles into its private staging and serves on; cachemgr publishes a snapshot."""

    name = "vllm"

    def check_can_compile(self, key: CacheKey) -> None:
        """``warm`` on a node without an NPU: refuse a model that cannot compile there, up front."""
        if not self.pod.options.warm or key.details.get("npu_from_device"):
            return
        from cachemgr.key.vllm_rbln import cpu_compile_refusal

        why = cpu_compile_refusal(key.server.settings, self.pod.environ)
        if why is not None:
            raise ConfigError(
                f"this warm Job runs without an NPU and cannot compile key {key.short}: {why}",
                remedy="run the warm Job on an NPU node (node affinity rebellions.ai/npu.present), or pass "
                "--model-impl vllm if the model runs on vllm-rbln's vLLM-model path",
            )

    def compile(self, root: CacheRoot, key: CacheKey, lease: KeyLease) -> Compiled:
        pod = self.pod
        staging = pod.new_staging(root, key)
        # The server writes through the attempt's open folder for as long as it runs (it re-saves
        # its bundle after every warm-up): held until _serve_on or a failure closes it.
        pin = contextlib.ExitStack()
        url = pod.health_url(key)
        pod.state.update(health_url=url)
        started = time.monotonic()
        watch: launcher.OutputWatch | None = None
        child = None
        healthy = threading.Event()
        try:
            pod.enter("compiling", strategy=self.name, staging=str(staging.path))
            self._start_progress(root, key, lease)
            env = {
                **pod.environ,
                "VLLM_CACHE_ROOT": str(pin.enter_context(safefs.pinned(root.path, staging.artifacts))),
            }
            # The server compiles as it starts: spawned under the relay, as on a hit.
            child = pod.relay.spawn(
                lambda: launcher.start(key.server.argv, env=env, capture=True, what="server")
            )
            watch = launcher.OutputWatch(child)
            monitor = launcher.ProgressMonitor(
                child, staging=staging.artifacts, output=watch, within=root.path
            )

            def tick() -> None:
                self._sample(monitor)
                if url is not None and health_ok(url):
                    healthy.set()

            code = launcher.run_until(child, events=[pod.relay.stop, watch.disk_full, healthy], every=tick)
            if code is None and not healthy.is_set():
                launcher.terminate_tree(child, grace=launcher.STOP_GRACE)
                code = child.returncode
            if not healthy.is_set():
                watch.join()
                # A compile-only server (VLLM_RBLN_COMPILE_ONLY=1) exits 0 once its artifacts are saved.
                failures.compile_ended(
                    code, watch, relay=pod.relay, what="server", key=key, compile_only_ok=True
                )
            self._stop_progress(staged=staging.artifacts)
            if self._check_loadable(key, staging, serving=healthy.is_set() and not pod.options.warm):
                self.publish(root, key, staging, lease, seconds=time.monotonic() - started)
            else:
                lease.release()  # nothing will be published: peers must not wait on this pod
        except BaseException as error:
            self._stop_progress()
            if child is not None:
                launcher.terminate_tree(child)
            pin.close()
            self._fail_attempt(root, key, staging, error, watch=watch, started=started)
            raise
        with pin:
            code = self._serve_on(key, child, watch, staging, serving=healthy.is_set())
        return Compiled(code)

    def _serve_on(
        self,
        key: CacheKey,
        child: subprocess.Popen[bytes],
        watch: launcher.OutputWatch,
        staging: Staging,
        *,
        serving: bool,
    ) -> int:
        """The server that compiled serves on from its staging until it exits; its code is the run's."""
        pod = self.pod
        if not serving or pod.options.warm:
            # Compile-only run, or a warm Job: the entry is published, the server is not needed.
            launcher.terminate_tree(child, grace=launcher.STOP_GRACE)
            pod.beats.discard(staging.owner_file)
            staging.discard()
            pod.state.phase("stopped", exit_code=0, published=True)
            return 0
        pod.state.phase("serving", entry=key.entry_name)
        code = launcher.wait_reaping(child, reaper=pod.reaper, stop=pod.relay.stop)
        watch.join(timeout=2.0)
        pod.state.phase("stopped", exit_code=code)
        pod.beats.discard(staging.owner_file)
        staging.discard()
        return code

    def publish(
        self, root: CacheRoot, key: CacheKey, staging: Staging, lease: KeyLease, *, seconds: float
    ) -> None:
        """Publish a hard-linked copy; the server keeps its own directory."""
        snapshot = self.pod.new_staging(root, key)
        try:
            method = snapshot_tree(staging.artifacts, snapshot.artifacts, within=root.path)
            log.info("snapshot", method=method, key=key.short)
            self.pod.publish(root, key, snapshot, lease, seconds=seconds)
        except BaseException:
            self.pod.beats.discard(snapshot.owner_file)  # first: no beat writes its record again
            snapshot.discard()
            raise
        finally:
            self.pod.beats.discard(snapshot.owner_file)

    def server_launch(self, key: CacheKey, view: Path) -> tuple[list[str], dict[str, str]]:
        return list(key.server.argv), {**self.pod.environ, "VLLM_CACHE_ROOT": str(view)}

    def watch_hit(self, root: CacheRoot, key: CacheKey, found: Lookup, view: Path) -> DriftWatch | None:
        """New compiled artifacts in the view mean the key missed something the server hashes."""
        if found.manifest is None:
            return None
        from cachemgr.volume import drift

        pod = self.pod

        def report(paths: list[str]) -> None:
            pod.metrics.recompiled_on_hit += 1
            log.warning(
                drift.EVENT,
                key=key.short,
                entry=found.path.name,
                new_paths=drift.shown(paths),
                count=len(paths),
                note="the server compiled although cachemgr found an entry: its key has an input cachemgr's lacks",
            )
            if not pod.read_only:  # a read-only volume gets nothing written, this record neither
                drift.record(root, key.digest, pod.identity, entry=found.path.name, paths=paths)

        def note(paths: list[str]) -> None:
            pod.metrics.resaved_on_hit += 1
            log.info(
                drift.RESAVED_EVENT,
                key=key.short,
                entry=found.path.name,
                paths=drift.shown(paths),
                count=len(paths),
                note="the server saved a bundle again with other bytes but not larger; whether it compiled "
                "cannot be told (rebel's bundles are not shown to be byte-stable), so this is no alarm",
            )

        watch = drift.DriftWatch(view, found.manifest, report=report, note=note, layouts=_layouts(key))
        watch.start(serving=lambda: pod.state.current.phase == "serving", exited=pod.server_exited)
        return watch


def _layouts(key: CacheKey) -> tuple[str, ...]:
    """How the key's release lays out its model paths' artifacts (cachemgr.key.release_model)."""
    from cachemgr.volume.drift import LAYOUTS

    return tuple(key.details.get("layouts") or LAYOUTS)


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (CommandStrategy, VllmStrategy)}


def render(argv: Sequence[str], **values: str) -> list[str]:
    """Fill ``{artifact_dir}`` / ``{output_dir}`` placeholders in argv words."""
    out = []
    for word in argv:
        filled = word
        for name, value in values.items():
            filled = filled.replace("{" + name + "}", value)
        out.append(filled)
    return out


def snapshot_tree(source: Path, target: Path, *, within: Path) -> str:
    """Hard-link every file of ``source`` into ``target`` (copy where links are refused).

    Returns "hardlink" or "copy". Directory structure and empty directories are kept. Both live
    under the cache root ``within``: ``source`` is walked from directory descriptors, never
    through a symlink (a link swapped in for the server's directory would otherwise publish,
    hard-link and chmod files from outside the volume), and each file is linked or copied from
    its own directory's descriptor. Anything but regular files and directories in the server's
    output is a failed compile: an entry holds nothing else.
    """
    method = "hardlink"
    safefs.make_dirs(within, target)
    with safefs.open_tree(source, within=within) as top:
        for rel, entry, parent in safewalk.walk(top):
            dst = target / rel
            if entry.is_dir(follow_symlinks=False):
                safefs.make_dirs(within, dst)
                continue
            if not entry.is_file(follow_symlinks=False):
                what = safefs.describe(entry.stat(follow_symlinks=False))
                raise CompileError(
                    f"the server left {what} at {rel} in its output; an entry holds only regular files "
                    "and directories",
                    remedy="nothing was published; the server's own compile cache must hold real files",
                    path=rel,
                )
            if method == "hardlink":
                try:
                    os.link(entry.name, dst, src_dir_fd=parent, follow_symlinks=False)
                    continue
                except OSError as error:
                    if error.errno not in _LINK_FALLBACK:
                        raise
                    method = "copy"
            _copy_at(parent, entry.name, dst)
    return method


def _copy_at(parent: int, name: str, dst: Path) -> None:
    """Copy file ``name`` of directory ``parent`` to a new ``dst``, mtime kept (never via a link)."""
    src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
    try:
        out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            while chunk := os.read(src, 1 << 20):
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
            st = os.fstat(src)
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
        finally:
            os.close(out)
    finally:
        os.close(src)
