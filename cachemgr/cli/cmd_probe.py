"""``cachemgr probe startup|live|ready``: a Kubernetes exec probe.

Prints one line saying why the probe passes or fails, and exits 0 (pass) or 1 (fail), as
exec probes expect; the kubelet shows the line in the pod's events when a probe fails. The
rules are in :mod:`cachemgr.runtime.probes`. Standard library only, like everything this command
imports: it runs in every pod every few seconds.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path

from cachemgr.runtime.probes import check
from cachemgr.runtime.state import DEFAULT_STATE_DIR

PASS, FAIL = 0, 1


def probe(args: argparse.Namespace, _server_argv: list[str], _environ: Mapping[str, str]) -> int:
    state_dir = Path(args.state_dir or DEFAULT_STATE_DIR)
    verdict = check(args.kind, state_dir, timeout=args.timeout)
    sys.stdout.write(verdict.line() + "\n")
    sys.stdout.flush()
    return PASS if verdict.ok else FAIL
