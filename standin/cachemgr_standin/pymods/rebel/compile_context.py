"""STAND-IN for ``rebel.compile_context`` (optimum/rbln/transformers/models/decoderonly/
modeling_decoderonly.py imports ``from rebel.compile_context import CompileContext``)."""

from typing import Any

from rebel._runtime import CompileContext

__all__ = ["CompileContext"]


def __getattr__(name: str) -> Any:
    """A name the real code reads that this module lacks: a placeholder, which refuses when called in
    strict mode (a ``missing`` event, as for the rest of the surface: rebel/__init__.py)."""
    if name.startswith("__"):
        raise AttributeError(name)
    from rebel import _missing

    return _missing(__name__)(name)
