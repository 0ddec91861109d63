"""STAND-IN for ``rebel.core.mega_cache``: the compiled graphs of the torch.compile backend, packed
into one bundle and back, in the two forms of the releases:

- vllm-rbln 0.12.0 (vllm_rbln/v1/worker/mega_cache.py:188-218): ``set_dir(root)``,
  ``read_bundle(file)`` -> info or None, ``write_bundle(file)`` -> truthy when it wrote something;
- vllm-rbln 0.11.2 (vllm_rbln/v1/worker/mega_cache.py:184-226): ``set_dir(root)``, then
  ``flush_to_bundle()`` hands the runtime's graphs to PyTorch's mega-cache, and vllm-rbln writes the
  bytes of ``torch.compiler.save_cache_artifacts()`` itself; it reads them back with
  ``torch.compiler.load_cache_artifacts(bytes)``. Here each graph is a cache artifact of a type of
  its own (``rbln_standin``, registered with ``torch.compiler._cache.CacheArtifactFactory``), whose
  ``populate_cache`` makes it compiled again.

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


# vllm-rbln 0.11.2: PyTorch's mega-cache carries the graphs (vllm_rbln/v1/worker/mega_cache.py:208-215).
_ARTIFACT = "rbln_standin"
_registered: list[Any] = []


def _artifact_type() -> str:
    """Register the stand-in's artifact type with PyTorch once (where torch is: the real server)."""
    if not _registered:
        from torch.compiler._cache import CacheArtifact, CacheArtifactFactory

        class _Graph(CacheArtifact):  # type: ignore[misc]
            """One compiled graph of the stand-in backend (its signature is the key)."""

            def populate_cache(self) -> None:
                compiled.add(self.key)
                event("bundle_read", ok=True, graphs=1, path=state["dir"])

            @staticmethod
            def type() -> str:
                return _ARTIFACT

        _registered.append(CacheArtifactFactory.register(_Graph))
    return _ARTIFACT


def flush_to_bundle() -> None:
    """Record every graph compiled or loaded in this process as a PyTorch cache artifact, for the
    ``torch.compiler.save_cache_artifacts()`` that follows; the bundle is then written by vllm-rbln
    (under ``state["dir"]``, the ``set_dir`` root)."""
    from torch.compiler._cache import CacheArtifactManager

    kind = _artifact_type()
    for graph in sorted(compiled):
        CacheArtifactManager.record_artifact(kind, graph, graph.encode())
    if compiled:
        event("bundle_write", graphs=len(compiled), path=state["dir"])


def _register_when_torch_is_there() -> None:
    """A fresh process reads a bundle before it flushes one: the type must be known by then
    (vllm-rbln imports this module right before ``load_cache_artifacts``, mega_cache.py:184-192)."""
    import importlib.util
    import sys

    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        _artifact_type()


_register_when_torch_is_there()


def __getattr__(name: str) -> Any:
    """A name the real code reads that this module lacks: a placeholder, which refuses when called in
    strict mode (a ``missing`` event, as for the rest of the surface: rebel/__init__.py)."""
    if name.startswith("__"):
        raise AttributeError(name)
    from rebel import _missing

    return _missing(__name__)(name)
