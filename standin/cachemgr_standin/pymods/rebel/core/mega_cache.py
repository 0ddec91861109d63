"""STAND-IN for ``rebel.core.mega_cache``: the compiled graphs of the torch.compile backend, packed
into one bundle and back (vllm_rbln/v1/worker/mega_cache.py:188-218: ``set_dir(root)``,
``read_bundle(file)`` -> info or None, ``write_bundle(file)`` -> truthy when it wrote something).

The stand-in backend (``rebel.core.torch_compile``) keeps the signatures of the graphs it compiled
in this process; a bundle is those signatures as JSON behind a header. Reading a bundle makes them
compiled: the backend then counts a load, not a compile."""

from __future__ import annotations

import json
from typing import IO, Any

from rebel._runtime import event

HEADER = b"STAND-IN RBLN MEGA-CACHE BUNDLE (cachemgr_standin)\n"
compiled: set[str] = set()
state: dict[str, Any] = {"dir": None}


def set_dir(path: str) -> None:
    state["dir"] = str(path)


def write_bundle(dst: IO[bytes]) -> bool:
    if not compiled:
        return False
    body = json.dumps(sorted(compiled)).encode()
    dst.write(HEADER + body + b"\n")
    event("bundle_write", graphs=len(compiled), path=getattr(dst, "name", None))
    return True


def read_bundle(src: IO[bytes]) -> dict[str, Any] | None:
    data = src.read()
    if not data.startswith(HEADER):
        event("bundle_read", ok=False, path=getattr(src, "name", None))
        return None
    try:
        graphs = json.loads(data[len(HEADER) :])
    except ValueError:
        event("bundle_read", ok=False, path=getattr(src, "name", None))
        return None
    compiled.update(str(g) for g in graphs)
    event("bundle_read", ok=True, graphs=len(graphs), path=getattr(src, "name", None))
    return {"graphs": len(graphs)}
