"""STAND-IN for ``rebel.compile_context`` (optimum/rbln/transformers/models/decoderonly/
modeling_decoderonly.py imports ``from rebel.compile_context import CompileContext``)."""

from rebel._runtime import CompileContext

__all__ = ["CompileContext"]
