"""STAND-IN for ``rebel.core.torch_compile``: ``rbln_backend(graph, example_inputs, **kwargs)``, the
torch.compile backend of the vLLM-model path (vllm_rbln/compilation/backends.py:24,136).

It runs the graph eagerly on the CPU. A graph's signature (its code and the shapes and dtypes of its
inputs) found in the mega-cache (read from a bundle, or compiled earlier in this process) is a load;
any other is a compile (``$STANDIN_REBEL_COMPILE_SECONDS`` each)."""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from rebel._runtime import event
from rebel.core import mega_cache


def _signature(graph: Any, example_inputs: Sequence[Any]) -> str:
    digest = hashlib.sha256(str(getattr(graph, "code", graph)).encode())
    for item in example_inputs:
        digest.update(
            repr((tuple(getattr(item, "shape", ())), str(getattr(item, "dtype", type(item))))).encode()
        )
    return digest.hexdigest()[:16]


def rbln_backend(graph: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    del kwargs
    sig = _signature(graph, example_inputs)
    if sig in mega_cache.compiled:
        event("backend_load", graph=sig)
    else:
        time.sleep(float(os.environ.get("STANDIN_REBEL_COMPILE_SECONDS") or 0))
        mega_cache.compiled.add(sig)
        event("backend_compile", graph=sig)
    forward: Callable[..., Any] = graph.forward
    return forward


def __getattr__(name: str) -> Any:
    """A name the real code reads that this module lacks: a placeholder, which refuses when called in
    strict mode (a ``missing`` event, as for the rest of the surface: rebel/__init__.py)."""
    if name.startswith("__"):
        raise AttributeError(name)
    from rebel import _missing

    return _missing(__name__)(name)
