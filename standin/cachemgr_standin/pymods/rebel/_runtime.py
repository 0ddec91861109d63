"""STAND-IN NPU runtime: what the real ``rebel`` compiler/runtime does for the real vllm-rbln and
optimum-rbln code, done on the CPU and logged, so a test can run the real ``vllm serve`` and count
its compiles and loads (issue 38).

Nothing here compiles or runs on an NPU. ``compile_from_torch`` records what it was asked for (the
input shapes, the NPU, the weights' size) as a ``.rbln`` file of its own format; ``Runtime`` answers
each call with zeros of the shape the real graph gives. Every call a test counts is an event: one
JSON line appended to ``$STANDIN_REBEL_EVENTS`` (``{"event": "compile"|"save"|"load"|"runtime"|
"bundle_write"|"bundle_read"|"backend_compile", "pid": ..., ...}``).

``$STANDIN_REBEL_COMPILE_SECONDS`` makes each compile take that long (a real compile takes minutes;
a test that signals a pod during the compile needs it to last); ``$STANDIN_REBEL_COMPILE_MARK``
names a file created as a compile begins. ``$STANDIN_REBEL_LOAD_SECONDS`` and
``$STANDIN_REBEL_LOAD_MARK`` do the same for each load of a saved compiled model.

The facts of the call surface come from the wheels' code (0.12.0 unless said), cited file:line.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

MAGIC = b"STAND-IN RBLN COMPILED MODEL (cachemgr_standin, not rebel-compiler)\n"
_lock = threading.Lock()


def event(kind: str, **fields: Any) -> None:
    """Append one event to ``$STANDIN_REBEL_EVENTS`` (one write of one line: whole under O_APPEND)."""
    path = os.environ.get("STANDIN_REBEL_EVENTS")
    if not path:
        return
    line = json.dumps({"event": kind, "pid": os.getpid(), "time": time.time(), **fields}, default=str) + "\n"
    with _lock:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)


def _nbytes(shape: Sequence[int], dtype: str) -> int:
    size = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2, "int8": 1}
    count = 1
    for dim in shape:
        count *= int(dim)
    return count * size.get(str(dtype).replace("torch.", ""), 4)


class CompileContext:
    """``rebel.CompileContext(use_weight_sharing=...)``, ``mark_static_address(tensor, name)``
    (optimum/rbln/transformers/models/decoderonly/modeling_decoderonly.py:263-270; vllm_rbln
    compilation/compiler.py:57 passes use_global_ctx too)."""

    def __init__(self, use_weight_sharing: bool = False, use_global_ctx: bool = False, **kwargs: Any) -> None:
        self.use_weight_sharing = use_weight_sharing
        self.use_global_ctx = use_global_ctx
        self.options = kwargs
        self.static: dict[str, tuple[int, ...]] = {}

    def mark_static_address(self, tensor: Any, name: str | None = None) -> None:
        self.static[name or f"static{len(self.static)}"] = tuple(getattr(tensor, "shape", ()))


def _output_shapes(model: Any, input_info: Sequence[Any]) -> list[list[int]]:
    """The shape of the graph's output. The stand-in runs no graph: for the causal LMs optimum-rbln
    compiles, the output is the logits, ``[batch, tokens, vocab]`` (decoderonly_runtime_utils.py
    474-485 allocates exactly that for prefill), batch and tokens those of the first input
    (input_ids or inputs_embeds), vocab the ``out_features`` of the last Linear (the lm_head,
    decoderonly_architecture.py:256,301); a wrapper without one gives the hidden states."""
    first = list(input_info[0][1]) if input_info else [1, 1]
    last = None
    for module in model.modules() if hasattr(model, "modules") else ():
        if type(module).__name__ == "Linear":
            last = module
    width = int(last.out_features) if last is not None else int(first[-1])
    return [[*first[:2], width]]


def compile_from_torch(
    model: Any,
    input_info: Sequence[Any],
    *,
    npu: str | None = None,
    num_devices: int = 1,
    example_inputs: Any = None,
    compile_context: CompileContext | None = None,
    **kwargs: Any,
) -> RBLNCompiledModel:
    """``rebel.compile_from_torch(model, input_info=..., npu=..., num_devices=..., example_inputs=...,
    compile_context=...)`` (optimum/rbln/modeling_base.py:531-537 with modeling_decoderonly.py:247)."""
    del example_inputs, compile_context
    mark = os.environ.get("STANDIN_REBEL_COMPILE_MARK")
    if mark:
        Path(mark).touch()
    started = time.monotonic()
    time.sleep(float(os.environ.get("STANDIN_REBEL_COMPILE_SECONDS") or 0))
    info = [[str(name), [int(d) for d in shape], str(dtype)] for name, shape, dtype in input_info]
    weights = 0
    if hasattr(model, "parameters"):
        weights = sum(int(p.numel()) * int(p.element_size()) for p in model.parameters())
    meta = {
        "input_info": info,
        "output_shapes": _output_shapes(model, input_info),
        "npu": npu,
        "num_devices": num_devices,
        "phase": getattr(model, "phase", None),
        "weights_bytes": weights,
        "options": sorted(kwargs),
    }
    event("compile", npu=npu, phase=meta["phase"], seconds=round(time.monotonic() - started, 3))
    return RBLNCompiledModel(meta=meta)


def compile(
    model: Any,
    input_info: Any = None,
    npu: str | None = None,
    num_devices: int = 1,
    dtype: Any = None,
    **kwargs: Any,
) -> RBLNCompiledModel:
    """``rebel.compile``: optimum and vllm-rbln only read its signature (``num_devices``,
    optimum/rbln/utils/runtime_utils.py:34; ``dtype``, vllm_rbln/compilation/compiler.py:50)."""
    del dtype
    return compile_from_torch(model, input_info or [], npu=npu, num_devices=num_devices, **kwargs)


class RBLNCompiledModel:
    """``rebel.RBLNCompiledModel(path)`` loads a saved model (optimum/rbln/modeling_base.py:212),
    ``.save(path)`` writes one (optimum/rbln/modeling.py:215), and the memory queries the
    KV-cache sizing reads (transformers/modeling_attention_utils.py:199,258,265,334,451)."""

    def __init__(
        self, path: str | os.PathLike[str] | None = None, *, meta: dict[str, Any] | None = None
    ) -> None:
        if meta is None:
            if path is None:
                raise TypeError("RBLNCompiledModel needs a path")
            mark = os.environ.get("STANDIN_REBEL_LOAD_MARK")
            if mark:
                Path(mark).touch()
            time.sleep(float(os.environ.get("STANDIN_REBEL_LOAD_SECONDS") or 0))
            meta = self._read(Path(path))
            event("load", path=str(path))
        self.meta = meta
        self.multiplier = int(meta.get("multiplier", 1))

    @staticmethod
    def _read(path: Path) -> dict[str, Any]:
        with path.open("rb") as src:
            head = src.read(len(MAGIC))
            if head != MAGIC:
                raise RuntimeError(f"STAND-IN rebel: {path} is not a compiled model (no stand-in header)")
            meta: dict[str, Any] = json.loads(src.readline())
        return meta

    def save(self, path: str | os.PathLike[str]) -> None:
        """The file holds the header, the record, and as many bytes as the weights: a real compiled
        model carries its weights, and a full volume must fill up as it would."""
        meta = {**self.meta, "multiplier": self.multiplier}
        with open(path, "wb") as dst:
            dst.write(MAGIC)
            dst.write(json.dumps(meta).encode() + b"\n")
            left = int(meta.get("weights_bytes", 0))
            block = b"\0" * (1 << 20)
            while left > 0:
                dst.write(block[: min(left, len(block))])
                left -= len(block)
        event("save", path=str(path), bytes=os.path.getsize(path))

    # The memory the compiled graph needs, per node and chiplet (one node, one chiplet here).
    def _kv_bytes(self) -> dict[str, int]:
        return {
            name: _nbytes(shape, dtype)
            for name, shape, dtype in self.meta["input_info"]
            if "past_key_values" in name
        }

    def get_alloc_per_node_by_key(self) -> dict[str, list[int]]:
        return {key: [sizes[0]] for key, sizes in self._alloc().items()}

    def get_alloc_per_chiplet_by_key(self) -> dict[str, list[list[int]]]:
        return {key: [sizes] for key, sizes in self._alloc().items()}

    def _alloc(self) -> dict[str, list[int]]:
        kv = sum(self._kv_bytes().values()) * self.multiplier
        return {"DramTensor": [kv], "Weights": [int(self.meta.get("weights_bytes", 0))]}

    def exp_get_dram_tensor_sizes(self) -> dict[str, list[list[int]]]:
        return {name: [[size * self.multiplier]] for name, size in self._kv_bytes().items()}

    def exp_multiply_buffer_size(self, *args: Any, **kwargs: Any) -> None:
        values = [*args, *kwargs.values()]
        number = next((v for v in values if isinstance(v, int) and not isinstance(v, bool)), 1)
        self.multiplier = int(number)


class Runtime:
    """``rebel.Runtime(compiled, tensor_type="pt", device=..., activate_profiler=..., timeout=...)``
    (optimum/rbln/transformers/models/decoderonly/modeling_decoderonly.py:648-655), called with the
    graph's tensors and ``out=`` (decoderonly_runtime_utils.py:347-357, 631-642): it fills ``out``
    when given and returns it, else returns new tensors of the graph's output shape."""

    def __init__(
        self, compiled: RBLNCompiledModel, tensor_type: str = "pt", device: Any = None, **kwargs: Any
    ) -> None:
        del kwargs
        self.compiled = compiled
        self.tensor_type = tensor_type
        self.device = device
        event("runtime", device=device, phase=compiled.meta.get("phase"))

    def __call__(self, *args: Any, out: Any = None, **kwargs: Any) -> Any:
        return self.run(*args, out=out, **kwargs)

    def run(self, *args: Any, out: Any = None, **kwargs: Any) -> Any:
        del args, kwargs
        import torch

        if out is not None:
            targets = out if isinstance(out, list | tuple) else [out]
            for tensor in targets:
                tensor.zero_()
            return out if isinstance(out, list | tuple) and len(out) > 1 else targets[0]
        shapes = self.compiled.meta["output_shapes"]
        tensors = [torch.zeros(shape, dtype=torch.float32) for shape in shapes]
        return tensors[0] if len(tensors) == 1 else tensors

    forward = run

    def __repr__(self) -> str:
        return f"<STAND-IN rebel.Runtime {self.compiled.meta.get('phase')}>"


@contextmanager
def capture_reports(*args: Any, **kwargs: Any) -> Iterator[list[Any]]:
    """``with rebel.capture_reports() as ...`` around a compile (vllm_rbln/v1/worker/
    optimum_model_runner.py:424): the stand-in compiler reports nothing."""
    del args, kwargs
    yield []


def npu_is_available(device_id: int = 0) -> bool:
    from rebel import get_npu_name

    return get_npu_name(device_id) is not None


def __getattr__(name: str) -> Any:
    """A name the real code reads that this module lacks: a placeholder, which refuses when called in
    strict mode (a ``missing`` event, as for the rest of the surface: rebel/__init__.py)."""
    if name.startswith("__"):
        raise AttributeError(name)
    from rebel import _missing

    return _missing(__name__)(name)
