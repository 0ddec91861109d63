"""The NPU type, resolved in the order vllm-rbln resolves it, and keyed as the server uses it.

vllm-rbln 0.12 asks the device first, then the settings (``vllm_rbln/platform/__init__.py``
136-151)::

    rebel.get_npu_name(device_id) or RBLN_FORCE_NPU_NAME or RBLN_TARGET_SOC

and hashes that string, unchanged, into its bundle signature (``v1/worker/mega_cache.py`` 69-76,
143-146). So where a device answers it decides, and a setting that disagrees with it is an error
(the server would compile for the device, not for the setting). Without a device, the server's own
settings decide; ``CACHEMGR_NPU_TYPE`` is cachemgr's, used only when the server has none (``key``
on a workstation) and checked against them when both are set.

The device query costs a child interpreter importing the compiler's runtime, so it runs only
where a device node exists: vllm-rbln's own test for "a card this process can open" is a
``/dev/rbln<N>`` node (``v1/worker/utils.py`` 185-189, 276-289). A CPU node pays one listdir.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Mapping
from typing import NamedTuple

from cachemgr.core.errors import ConfigError

# How RBLN names its NPUs (RBLN-CA25, RBLN-CR13): what the device reports, and the only form a setting
# may take. vllm-rbln hashes the setting as written (mega_cache.py 69-76, 143-146: f"npu={npu}"),
# while it tests the family on the upper-cased, stripped name (platform/__init__.py 155-161), so
# " RBLN-CA25" or "rbln-ca25" would compile for a CA25 under another signature: refused, with the
# name it should be.
_NPU_NAME = re.compile(r"RBLN-[A-Z0-9][A-Z0-9-]{0,26}")
# What a device may answer: its own name, kept as it is (any plain token, so a new NPU still works).
_DEVICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]{0,31}")
_NPU_IN_TEXT = re.compile(r"\bRBLN-[A-Z]{2}\d{2}\b")
_DEVICE_NODE = re.compile(r"rbln\d+")
_DEVICE_TIMEOUT = 30.0
# Where the device nodes are. The stand-in's tests point it at a directory holding a fake
# ``rbln0`` (with standin/cachemgr_standin/pymods on PYTHONPATH for a fake ``rebel``); nothing else should.
DEV_DIR_ENV = "CACHEMGR_RBLN_DEV_DIR"
# In a child: the compiler's runtime is heavy and must not stay loaded in the supervisor.
_QUERY = (
    "import sys\n"
    "try:\n    import rebel\nexcept ImportError:\n    sys.exit(3)\n"
    "print(rebel.get_npu_name(0) or '')\n"
)
# The server's settings, in the order vllm-rbln reads them after the device.
SERVER_SETTINGS = ("RBLN_FORCE_NPU_NAME", "RBLN_TARGET_SOC")
# What the modelserver chart sets from its npu.type value (CACHEMGR_NPU_TYPE in every pod,
# RBLN_FORCE_NPU_NAME in the warm Jobs); it refuses both in a role's extraEnv.
_CHART_SETS = frozenset({"CACHEMGR_NPU_TYPE", "RBLN_FORCE_NPU_NAME"})


class Npu(NamedTuple):
    """The resolved NPU name, where it came from, and what the device query cost."""

    name: str
    source: str
    from_device: bool
    device_nodes: int
    query_seconds: float


def resolve(override: str | None, environ: Mapping[str, str], *, probe: bool = True) -> Npu:
    """Device, else the server's settings, else CACHEMGR_NPU_TYPE; never "unknown"."""
    ours = override or environ.get("CACHEMGR_NPU_TYPE") or None
    settings = [(name, environ.get(name) or "") for name in SERVER_SETTINGS]
    started = time.monotonic()
    nodes = device_nodes(environ) if probe else []
    answer = query_device(environ) if nodes else None
    spent = time.monotonic() - started
    for name, value in [("CACHEMGR_NPU_TYPE", ours or ""), *settings]:
        if value:
            _check_setting(value, name)
    if answer is not None:
        name, source = answer
        valid = _device_name(name, source)
        _check_agrees(valid, source, [("CACHEMGR_NPU_TYPE", ours or ""), *settings])
        return Npu(valid, source, True, len(nodes), spent)
    server = next(((name, value) for name, value in settings if value), None)
    if server is not None:
        _check_agrees(server[1], server[0], [("CACHEMGR_NPU_TYPE", ours or "")])
        return Npu(server[1], server[0], False, len(nodes), spent)
    if ours:
        return Npu(ours, "CACHEMGR_NPU_TYPE", False, len(nodes), spent)
    raise ConfigError(
        "cannot tell the NPU type: no RBLN device answered (no /dev/rbln* node, or rebel.get_npu_name(0) "
        "gave nothing) and RBLN_FORCE_NPU_NAME, RBLN_TARGET_SOC and CACHEMGR_NPU_TYPE are unset",
        remedy="set RBLN_FORCE_NPU_NAME to the target NPU (the server needs it too without a device), "
        "e.g. RBLN_FORCE_NPU_NAME=RBLN-CA25",
    )


def _check_agrees(name: str, source: str, settings: list[tuple[str, str]]) -> None:
    for setting, value in settings:
        if value and value != name:
            named = f"{source}={name}" if source in SERVER_SETTINGS else f"the NPU {source} reports ({name})"
            raise ConfigError(
                f"{setting}={value} disagrees with {named}; vllm-rbln compiles for the latter",
                remedy=f"unset {setting} or set it to {name}{_chart(setting)}",
            )


def _check_setting(value: str, setting: str) -> None:
    """A name given in a setting must be written as RBLN writes it: the server keys it as written."""
    if _NPU_NAME.fullmatch(value):
        return
    meant = value.strip().upper()
    shown = _shown(value)
    if _NPU_NAME.fullmatch(meant):
        raise ConfigError(
            f"{setting}={shown} is not written as RBLN names the NPU ({meant}): vllm-rbln would compile "
            "for the name as written, under another cache key than every pod that writes it right",
            remedy=f"set {setting} to {meant}{_chart(setting)}",
        )
    raise ConfigError(
        f"{setting}={shown} is not an NPU name (RBLN names them like RBLN-CA25, RBLN-CR13)",
        remedy=f"set {setting} to the target NPU, e.g. RBLN-CA25{_chart(setting)}",
    )


def _shown(value: str) -> str:
    """Quoted, so blanks show; escaped (repr), so nothing reaches a terminal raw; cut at 40."""
    return repr(value if len(value) <= 40 else value[:40] + "...")


def _chart(setting: str) -> str:
    """Under the modelserver chart both variables come from one value (npu.type)."""
    return " (with the modelserver chart: its npu.type value)" if setting in _CHART_SETS else ""


def _device_name(value: str, source: str) -> str:
    """The name the device reports, as the server hashes it, if it is a name."""
    name = value.strip()
    if not _DEVICE_NAME.fullmatch(name):
        raise ConfigError(
            f"the NPU {source} reports is {_shown(value)}, which is not an NPU name",
            remedy="check the RBLN driver (rbln-smi); until then set RBLN_FORCE_NPU_NAME and start without the device",
        )
    return name


def device_nodes(environ: Mapping[str, str]) -> list[str]:
    """The ``rbln<N>`` device nodes this pod can open (vllm-rbln's ``_rbln_present_card_indices``)."""
    try:
        names = os.listdir(environ.get(DEV_DIR_ENV) or "/dev")
    except OSError:
        return []
    return sorted(name for name in names if _DEVICE_NODE.fullmatch(name))


def query_device(environ: Mapping[str, str]) -> tuple[str, str] | None:
    """``rebel.get_npu_name(0)``, as vllm-rbln asks; the driver's tool where rebel is missing."""
    import shutil  # only where a device node exists: a CPU node's key never needs it

    output = _run_quietly([sys.executable, "-c", _QUERY], environ)
    if output is not None:
        name = output.strip()
        return (name, "rebel.get_npu_name(0)") if name else None
    for tool in ("rbln-smi", "rbln-stat"):
        exe = shutil.which(tool, path=environ.get("PATH"))
        if exe is None:
            continue
        # The first card listed is device 0, the one vllm-rbln asks about.
        names = _NPU_IN_TEXT.findall(_run_quietly([exe], environ) or "")
        if names:
            return names[0], tool
    return None


def _run_quietly(argv: list[str], environ: Mapping[str, str]) -> str | None:
    import subprocess

    try:
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=_DEVICE_TIMEOUT, env=dict(environ), check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None
