"""STAND-IN start-up for the real vLLM server on the CPU (issue 38's tier; only this tier puts this
directory on PYTHONPATH, beside ``pymods``).

The registry's torchvision 0.28.0 is built against the CUDA torch: its compiled ``_C`` does not load
beside the CPU torch, so its operators are never registered, and its Python parts then fail to
import: ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` at import. vLLM imports torchvision (through transformers' image processors),
so this defines the two operators' schemas, as torchvision's ``_C`` would, right before torchvision
is first imported; nothing here runs them (no path of this tier calls nms).
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
from typing import Any

_libraries: list[Any] = []


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        del path, target
        if fullname == "torchvision" and not _libraries:
            import torch

            lib = torch.library.Library("torchvision", "FRAGMENT")
            _libraries.append(lib)
            for schema in (
                "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
                "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            ):
                with contextlib.suppress(RuntimeError):  # defined: a torchvision whose _C loads
                    lib.define(schema)
        # the ordinary finders import it


sys.meta_path.insert(0, _BeforeTorchvision())
