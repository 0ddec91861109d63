"""Write a ``vllm`` executable that runs the stand-in server (NOT vLLM).

cachemgr recognises the server by argv (basename ``vllm``, then ``serve``), so tests and the demo
put the shim's directory first on PATH and run the literal ``vllm serve MODEL ...``.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

import cachemgr

_TEMPLATE = """#!/bin/sh
# STAND-IN for the `vllm` command, written by cachemgr_standin.shim.write_vllm_shim.
# This is NOT vLLM: it runs cachemgr_standin.server, which imitates vllm-rbln's compile caching.
PYTHONPATH={root}${{PYTHONPATH:+:$PYTHONPATH}}
export PYTHONPATH
exec {python} -m cachemgr_standin.server "$@"
"""


def write_vllm_shim(bin_dir: Path) -> Path:
    """Write ``bin_dir/vllm`` (mode 755) and return its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    # The directory holding the cachemgr package goes on PYTHONPATH, so the shim works from any
    # cwd even where cachemgr is not installed into sys.executable's environment.
    root = Path(cachemgr.__file__).resolve().parent.parent
    script = _TEMPLATE.format(root=shlex.quote(str(root)), python=shlex.quote(sys.executable))
    return write_executable(bin_dir / "vllm", script)


def write_executable(target: Path, script: str) -> Path:
    """Write ``script`` to ``target`` (mode 755) and return it. Write then rename: a concurrent
    reader never runs a half-written script."""
    staging = target.parent / f".{target.name}.{os.getpid()}.tmp"
    staging.write_text(script, encoding="utf-8")
    staging.chmod(0o755)
    staging.replace(target)
    return target
