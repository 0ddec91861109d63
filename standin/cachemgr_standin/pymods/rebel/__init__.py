"""STAND-IN for the RBLN Compiler's ``rebel`` module (NOT rebel-compiler): the device query, and
the import surface the real vllm-rbln code needs to build its configuration.

Put ``standin/cachemgr_standin/pymods`` on PYTHONPATH to make ``import rebel`` find this. It answers
``get_npu_name(device_id)`` as the real runtime does: the NPU's name where a device is mounted,
None without one. The name is ``$STANDIN_NPU_NAME`` (default ``RBLN-CA25``; ``none`` or empty: no
device), the same knob the stand-in server reads. cachemgr asks it only where a ``rbln<N>``
device node exists (``$CACHEMGR_RBLN_DEV_DIR`` points at a directory holding one in tests).

A slow driver: ``$STANDIN_NPU_QUERY_SECONDS`` makes the query take that long (a real first query
initialises the driver); ``$STANDIN_NPU_QUERY_MARK`` names a file created as the query begins, so a
test knows the key is being resolved now.

The import surface (for the key oracle, tools/oracle/: the real vLLM, vllm-rbln and optimum-rbln
code builds its ``VllmConfig`` here, without an NPU): vllm-rbln imports ``rebel.*`` submodules and
names (``from rebel import triton``, ``rebel.core.mega_cache``...) and ``torch.rbln`` (torch-rbln,
which registers PyTorch's out-of-tree device as ``rbln``) at module level, though building a
configuration calls none of them but ``get_npu_name`` and ``__version__``. Importing this module
installs a finder that makes every ``rebel.<x>`` and ``torch.rbln`` importable; any name read from
them is a placeholder that can be called, decorated with, subclassed and annotated with, and
does nothing. Code that really compiles or runs would get nothing from it: only configuration
building is stood in for.

The NPU runtime (issue 38, for the real-server tier, tests/test_realserver*.py): ``compile_from_torch``,
``CompileContext``, ``RBLNCompiledModel``, ``Runtime``, ``core.mega_cache`` and
``core.torch_compile.rbln_backend`` and the ``torch.ops.rbln*`` operators the real code calls are
stood in for on the CPU, each call an event a test counts (``rebel/_runtime.py``, ``rebel/_ops.py``).
``$STANDIN_REBEL_STRICT=1`` (that tier) turns the runtime on; without it (the key oracle) the module
is the import surface above, as it was. In strict mode calling any other name fails loudly, a
``NotImplementedError`` naming it, also recorded as a ``missing`` event (so a test sees it even where
the real code swallows the error); importing it, annotating and decorating with it still work, since
the real code does that at import time for features it never uses here.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from typing import Any

STRICT = os.environ.get("STANDIN_REBEL_STRICT") == "1"

if STRICT:  # the NPU runtime of the real-server tier; the oracle keeps the import surface as it was
    from rebel._runtime import (  # the names the real code calls
        CompileContext,
        RBLNCompiledModel,
        Runtime,
        capture_reports,
        compile,
        compile_from_torch,
        event,
        npu_is_available,
    )
else:
    from rebel._runtime import event

__all__ = [  # the runtime's names are there with STANDIN_REBEL_STRICT=1
    "CompileContext",
    "RBLNCompiledModel",
    "Runtime",
    "capture_reports",
    "compile",
    "compile_from_torch",
    "device_count",
    "get_npu_name",
    "manual_seed",
    "npu_is_available",
]

# The compiler version vllm-rbln reads (mega_cache._rebel_major_minor: major.minor only).
__version__ = os.environ.get("STANDIN_REBEL_VERSION") or "0.12.0+standin"


def get_npu_name(device_id: int = 0) -> str | None:
    """The NPU name of ``device_id``, or None when no device answers."""
    del device_id  # one NPU type per node
    mark = os.environ.get("STANDIN_NPU_QUERY_MARK")
    if mark:
        with open(mark, "a"):
            pass
    time.sleep(float(os.environ.get("STANDIN_NPU_QUERY_SECONDS") or 0))
    name = os.environ.get("STANDIN_NPU_NAME", "RBLN-CA25").strip()
    return None if name.lower() in {"", "none"} else name


def device_count() -> int:
    return 0 if get_npu_name(0) is None else 1


def manual_seed(seed: int) -> None:
    del seed  # no device: nothing to seed


class Placeholder:
    """Any name of the stood-in surface: callable, a decorator, a base class, an annotation."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, item: str) -> Placeholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return Placeholder(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and not kwargs and callable(args[0]):
            if STRICT:
                return _refusing(f"{self._name}({getattr(args[0], '__name__', '...')})")
            return args[0]  # used as a decorator: the function stays itself
        if STRICT:
            _refuse(f"{self._name}(...)")
        return Placeholder(f"{self._name}()")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)  # ``class X(rebel.Base)`` makes a plain class

    def __getitem__(self, item: Any) -> Placeholder:
        return Placeholder(f"{self._name}[...]")

    def __or__(self, other: Any) -> Placeholder:
        return self  # ``CompileContext | None`` in an annotation

    __ror__ = __or__

    def __iter__(self) -> Iterator[Any]:
        return iter(())

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"<STAND-IN {self._name}>"


def _refuse(name: str) -> None:
    event("missing", name=name)
    raise NotImplementedError(
        f"STAND-IN rebel (cachemgr_standin, STANDIN_REBEL_STRICT=1): the real code called {name}, "
        "which the stand-in NPU runtime does not provide; add it to standin/cachemgr_standin/pymods"
    )


def _refusing(name: str) -> Callable[..., Any]:
    """What a decorator of the stood-in surface makes in strict mode: a function that refuses."""

    def refused(*args: Any, **kwargs: Any) -> Any:
        del args, kwargs
        _refuse(name)

    refused.__name__ = name
    return refused


def _missing(module: str) -> Callable[[str], Any]:
    def attribute(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return Placeholder(f"{module}.{name}")

    return attribute


def __getattr__(name: str) -> Any:  # module attributes not defined above: ``from rebel import triton``
    here = os.path.dirname(__file__)
    if os.path.exists(os.path.join(here, name)) or os.path.exists(os.path.join(here, f"{name}.py")):
        import importlib

        return importlib.import_module(f"rebel.{name}")  # a stood-in submodule of its own
    return _missing("rebel")(name)


class _Surface(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``rebel.<anything>`` and ``torch.rbln`` importable as stand-in modules."""

    def find_spec(
        self, fullname: str, path: Any = None, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        del path, target
        if fullname.startswith(("rebel.", "torch.rbln.")) or fullname == "torch.rbln":
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name, "STAND-IN (cachemgr_standin): import surface only")
        module.__path__ = []
        module.__getattr__ = _missing(spec.name)  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torch.rbln":
            import torch  # only where the real vllm-rbln imports torch.rbln: torch is installed there

            # What torch-rbln does on import: name PyTorch's out-of-tree device "rbln", so that
            # torch.device("rbln") (vLLM's DeviceConfig on the vLLM-model path) is a device type.
            if torch._C._get_privateuse1_backend_name() != "rbln":
                torch.utils.rename_privateuse1_backend("rbln")
            if STRICT:  # the device queries and operators of the real-server tier
                from rebel import _ops, _torch_rbln

                _ops.register()
                for name in _torch_rbln.__all__:
                    setattr(module, name, getattr(_torch_rbln, name))


if not any(isinstance(finder, _Surface) for finder in sys.meta_path):
    sys.meta_path.append(_Surface())


def _register_ops_when_torch_is_there() -> None:
    """The operators rebel registers on import (``torch.ops.rbln_custom_ops.linear`` is read at
    compile time, modeling_decoderonly.py:246), where torch is installed (not in cachemgr's venv)."""
    import importlib.util

    if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
        from rebel import _ops

        _ops.register()


if STRICT:
    _register_ops_when_torch_is_there()
