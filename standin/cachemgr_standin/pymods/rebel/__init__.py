"""STAND-IN for the RBLN Compiler's ``rebel`` module (NOT rebel-compiler): the device query only.

Put ``standin/cachemgr_standin/pymods`` on PYTHONPATH to make ``import rebel`` find this. It answers
``get_npu_name(device_id)`` as the real runtime does: the NPU's name where a device is mounted,
None without one. The name is ``$STANDIN_NPU_NAME`` (default ``RBLN-CA25``; ``none`` or empty: no
device), the same knob the stand-in server reads. cachemgr asks it only where a ``rbln<N>``
device node exists (``$CACHEMGR_RBLN_DEV_DIR`` points at a directory holding one in tests).

A slow driver: ``$STANDIN_NPU_QUERY_SECONDS`` makes the query take that long (a real first query
initialises the driver); ``$STANDIN_NPU_QUERY_MARK`` names a file created as the query begins, so a
test knows the key is being resolved now.
"""

from __future__ import annotations

import os
import time

__version__ = "0.12.0+standin"


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
