"""``helm upgrade --dry-run=client`` of the chart, offline: what Helm does at an upgrade, not a template.

``helm template --is-upgrade`` renders templates with ``.Release.IsUpgrade``, but it prints no
NOTES and does not sort hooks from the release's objects. ``helm upgrade --dry-run=client`` does
both, through Helm's own upgrade action; it needs a previous release and the server's version.
The previous release comes from Helm's memory driver (``HELM_DRIVER=memory``, loaded from
``HELM_MEMORY_DRIVER_DATA``): the JSON ``helm install --dry-run=client -o json`` prints, marked
deployed. The server's version comes from ``DiscoveryStandIn``, a stand-in for the Kubernetes API
server's discovery endpoints (``/version``, ``/api``, ``/apis``): all that a client dry run asks.
It answers nothing else (404), so ``lookup`` finds nothing, as in any client dry run.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cachemgr_testkit.helm import CHART, helm, values_file

_DISCOVERY: dict[str, dict[str, Any]] = {
    "/version": {"major": "1", "minor": "33", "gitVersion": "v1.33.0", "platform": "linux/amd64"},
    "/api": {"kind": "APIVersions", "versions": ["v1"]},
    "/apis": {"kind": "APIGroupList", "apiVersion": "v1", "groups": []},
}


class _Discovery(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = _DISCOVERY.get(self.path.split("?", 1)[0])
        data = json.dumps(body).encode() if body is not None else b"{}"
        self.send_response(200 if body is not None else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextmanager
def discovery_stand_in(work: Path) -> Iterator[Path]:
    """A kubeconfig pointing at the stand-in, served from a thread until the block ends."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Discovery)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        work.mkdir(parents=True, exist_ok=True)
        config = work / "kubeconfig"
        config.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "stand-in", "cluster": {"server": f"http://127.0.0.1:{server.server_port}"}}
                    ],
                    "contexts": [{"name": "stand-in", "context": {"cluster": "stand-in"}}],
                    "current-context": "stand-in",
                    "users": [],
                }
            )
        )
        yield config
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def upgrade(
    installed: dict[str, Any],
    values: dict[str, Any],
    *,
    work: Path,
    release: str = "modelserver",
    namespace: str = "default",
) -> dict[str, Any]:
    """The release ``helm upgrade --dry-run=client -o json`` makes of ``values`` over a release
    installed with ``installed``: its ``manifest``, its ``hooks`` and its ``info.notes``."""
    work.mkdir(parents=True, exist_ok=True)
    first = helm(
        "install", release, str(CHART), "--namespace", namespace, "--dry-run=client", "-o", "json",
        "-f", str(values_file(work, installed)),
    )  # fmt: skip
    previous = json.loads(first.stdout)
    previous["info"]["status"] = "deployed"
    releases = work / "releases.json"
    releases.write_text(json.dumps([previous]))
    with discovery_stand_in(work) as kubeconfig:
        result = helm(
            "upgrade", release, str(CHART), "--namespace", namespace, "--dry-run=client", "-o", "json",
            "-f", str(values_file(work, values)),
            env={
                "KUBECONFIG": str(kubeconfig),
                "HELM_DRIVER": "memory",
                "HELM_MEMORY_DRIVER_DATA": str(releases),
            },
            check=False,
        )  # fmt: skip
    if result.returncode != 0:
        raise AssertionError(f"helm upgrade --dry-run=client refused {values}:\n{result.stderr}")
    upgraded: dict[str, Any] = json.loads(result.stdout)
    return upgraded
