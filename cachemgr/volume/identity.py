"""Who acts on the volume: a pod, its node and its process, as records name them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class PodIdentity:
    """Who is acting: the pod (HOSTNAME in Kubernetes), its node (downward API) and process."""

    pod: str
    node: str
    host: str
    pid: int

    @classmethod
    def current(cls, environ: Mapping[str, str] | None = None) -> PodIdentity:
        env = os.environ if environ is None else environ
        host = os.uname().nodename  # gethostname(2); the socket module costs a pod's start ~2 ms
        return cls(
            pod=env.get("POD_NAME") or env.get("HOSTNAME") or host,
            node=env.get("NODE_NAME") or env.get("CACHEMGR_NODE_NAME") or "",
            host=host,
            pid=os.getpid(),
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def record_name(self) -> str:
        return f"{self.pod}.{self.pid}.json"
