"""STAND-IN for ``torch.rbln`` (torch-rbln): the device queries vllm-rbln makes
(vllm_rbln/v1/worker/utils.py:331-337, dynamic_kv_sizer.py:160-173). There is no device memory:
``is_dummy_device()`` is True, which the real code takes as "no real device to size against". And the device module protocol PyTorch calls on a
privateuse1 backend (torch/random.py:84-136 asks ``_is_in_bad_fork`` and ``manual_seed_all`` when
vLLM seeds, vllm/utils/torch_utils.py:541)."""

from __future__ import annotations

from typing import Any

__all__ = [
    "_is_in_bad_fork",
    "_lazy_init",
    "current_device",
    "device_count",
    "empty_cache",
    "is_available",
    "is_dummy_device",
    "manual_seed",
    "manual_seed_all",
    "release_offload_temp_storage",
    "set_device",
    "synchronize",
]


def is_available() -> bool:
    """No tensor lives on an ``rbln`` device here (PyTorch has no kernels for one on the CPU): False,
    so torch.accelerator and dynamo (torch/_dynamo/variables/streams.py:272) keep to the CPU; the
    tier runs host tensors (VLLM_RBLN_USE_DEVICE_TENSOR=0)."""
    return False


def device_count() -> int:
    from rebel import get_npu_name

    return 0 if get_npu_name(0) is None else 1


def is_dummy_device() -> bool:
    return True


def empty_cache(device: Any = None) -> None:
    del device


def manual_seed(seed: int) -> None:
    del seed


def synchronize(device: Any = None) -> None:
    del device


def manual_seed_all(seed: int) -> None:
    del seed


def _is_in_bad_fork() -> bool:
    return False


def current_device() -> int:
    return 0


def set_device(device: Any) -> None:
    del device


def _lazy_init() -> None:
    """vLLM's worker initialises the device's runtime lazily, as for CUDA: nothing to do on the CPU."""


def release_offload_temp_storage() -> int:
    """How many offload temporary files were removed (vllm_rbln/v1/worker/rbln_worker.py:740-749 asks
    as a worker stops): none, the stand-in offloads nothing (no device tensors)."""
    return 0
