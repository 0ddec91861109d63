"""Counters of one ``run``: what the pod did, for ``/metrics`` and the logs."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Metrics:
    hits: int = 0
    misses: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    lease_wait_seconds: float = 0.0
    damaged: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    phase: str = "resolving"

    def failure(self, reason: str) -> None:
        self.failures[reason] += 1

    def on_phase(self, _old: Any, new: Any) -> None:
        self.phase = new.phase
