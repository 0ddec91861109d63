"""The launch step: the server on a pod-local view of a published entry, supervised until it exits.

The last step of the flow (cachemgr.runtime.runner): the hit's view (cachemgr.runtime.views),
the spawn, readiness (cachemgr.runtime.health), the read-ahead hooked up after the spawn
(cachemgr.runtime.prefetch), and the wait, reaping orphans, for the server's exit code. A warm
Job ends here without a server. A configuration whose artifacts cachemgr cannot hold (its model
path's layout: the compiler caches them itself) starts its server without the cache:
:func:`pass_through`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachemgr.core.errors import ConfigError
from cachemgr.core.fsutil import remove_tree
from cachemgr.core.log import get_logger
from cachemgr.core.log import release as release_logs
from cachemgr.runtime import failures, launcher
from cachemgr.runtime.health import watch_readiness
from cachemgr.runtime.output import ServerOutput
from cachemgr.runtime.views import build_view, remove_old_views_later

if TYPE_CHECKING:
    from pathlib import Path

    from cachemgr.key.cachekey import CacheKey
    from cachemgr.runtime.pod import Pod
    from cachemgr.runtime.prefetch import Prefetch
    from cachemgr.runtime.strategies import Strategy
    from cachemgr.volume.layout import CacheRoot
    from cachemgr.volume.store import Lookup

log = get_logger("cachemgr.run")

_OUTPUT_GRACE = 2.0  # seconds for the server's last output after it exits (its children may keep the pipe)


def launch(pod: Pod, root: CacheRoot, key: CacheKey, found: Lookup, strategy: Strategy) -> int:
    """The server on a pod-local view of the entry, supervised until it exits (warm: exit 0)."""
    assert found.manifest is not None  # a hit always has one
    if pod.options.warm:
        log.info("already_published", key=key.short, entry=found.path.name)
        pod.state.phase("stopped", exit_code=0, published=True)
        return 0
    views = pod.options.state_dir / "views"
    view = _view(pod, views, found)
    url = pod.health_url(key)
    try:
        argv, env = strategy.server_launch(key, view)
        env["CACHEMGR_ARTIFACT_DIR"] = str(view)
        pod.state.update(health_url=url)
        pod.enter("launching", entry=found.path.name)  # a signal since the lookup ends the run here
        log.info("launching", key=key.short, entry=found.path.name, view=str(view), signer=found.signer)
        child = pod.relay.spawn(lambda: launcher.start(argv, env=env, capture="tail", what="server"))
    except BaseException:
        remove_tree(view.parent)  # no server will read it
        raise
    output = ServerOutput(child)
    read_ahead = None if pod.options.prefetch == "off" else _read_ahead(pod, root, found, child.pid)
    release_logs()
    watch_readiness(url, child, state=pod.state, stall=pod.stall, exited=pod.server_exited)
    drift = strategy.watch_hit(root, key, found, view)
    remove_old_views_later(views, keep=view)
    code = launcher.wait_reaping(child, reaper=pod.reaper, stop=pod.relay.stop)
    pod.server_exited.set()
    ready = pod.state.current.phase == "serving"
    if read_ahead is not None:
        read_ahead.close()
    output.join(timeout=_OUTPUT_GRACE)
    if drift is not None:
        drift.check()  # a compile-only server exits without ever serving
    stopped_by = pod.relay.stopped_child
    if code != 0 and not ready and stopped_by is None:
        # Not stopped by the pod's own signal (one that reached it while it ran: a SIGTERM after
        # its death does not make the death a stop), never ready: the launch failed (the entry,
        # the node, the server's configuration: its last lines say which).
        from cachemgr.runtime import server_failures  # only for a server that failed

        error = failures.server_failed(
            child.returncode,
            key=key,
            entry=found.path.name,
            last_lines=output.lines(),
            raised=output.raised(),
        )
        raise server_failures.recorded(
            pod, root, key, found, error
        )  # beside the entry: ls, show, prune --key
    return _stopped(pod, code, ready=ready)


def _stopped(pod: Pod, code: int, *, ready: bool) -> int:
    """The run's code once its server exited, said in the state: the server's own, except after the
    pod's own stop before it served: then 128+N, whatever the server made of the signal (the real
    vLLM exits 130 from its start-up's KeyboardInterrupt, or is killed after the stop's grace), as
    every stop before a server runs ends. Whether the pod's signal reached the server while it ran
    is said too: a stop and a death of its own, just before the signal, can end in the same code."""
    stopped_by = pod.relay.stopped_child
    said: dict[str, object] = {"stopped_by": stopped_by} if stopped_by else {}
    if stopped_by is not None and not ready:
        said["server_exit_code"] = code
        code = 128 + (pod.relay.received or 15)
    pod.state.phase("stopped", exit_code=code, **said)
    return code


def pass_through(pod: Pod, key: CacheKey) -> int:
    """``run`` for a configuration cachemgr cannot cache: the server, started as given, supervised
    until it exits; nothing looked up, leased, compiled for or published. ``warm`` refuses it (78)."""
    why = "; ".join(key.details["layout_uncacheable"])
    if pod.options.warm:
        raise ConfigError(
            f"warm cannot cache key {key.short}: {why}",
            remedy="nothing to warm for this configuration: its pods compile as they start "
            "('cachemgr run' starts the server without the cache)",
        )
    log.warning("not_cacheable", key=key.short, reason=why, note="the server starts without the cache")
    url = pod.health_url(key)
    pod.state.update(health_url=url)
    pod.enter("launching", entry=None)
    argv, env = key.server.argv, dict(pod.environ)
    child = pod.relay.spawn(lambda: launcher.start(argv, env=env, capture="tail", what="server"))
    output = ServerOutput(child)
    release_logs()
    watch_readiness(url, child, state=pod.state, stall=pod.stall, exited=pod.server_exited)
    code = launcher.wait_reaping(child, reaper=pod.reaper, stop=pod.relay.stop)
    pod.server_exited.set()
    output.join(timeout=_OUTPUT_GRACE)
    return _stopped(pod, code, ready=pod.state.current.phase == "serving")


def _view(pod: Pod, views: Path, found: Lookup) -> Path:
    assert found.manifest is not None
    try:
        return build_view(views, found.path, found.manifest, stop=pod.relay.stop)
    except InterruptedError:
        raise failures.interrupted(pod.relay) from None  # SIGTERM while the view was built
    except OSError as error:
        raise failures.view_failed(error, views, files=len(found.manifest.files)) from error


def _read_ahead(pod: Pod, root: CacheRoot, found: Lookup, pid: int) -> Prefetch | None:
    """The entry into the page cache while the server initialises; after the spawn, never before.
    A trusting pod's hit was read whole by its content check before the launch: not again."""
    from cachemgr.runtime import prefetch  # imported after the spawn

    if pod.options.trusted:
        prefetch.checked_before_launch(found)
        return None
    stops = (pod.relay.stop, pod.server_exited)
    reader = prefetch.Prefetch(found, within=root.path, server_pid=pid, stops=stops, metrics=pod.metrics)
    return reader.start()
