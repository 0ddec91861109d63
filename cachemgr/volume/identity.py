"""Who acts on the volume: a pod, its node and its process, as records name them."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

# A pod name used as is in file names: what Kubernetes names pods (DNS-1123: lower-case
# alphanumerics, '-' and '.'), upper case and '_' too, not starting with a dot, and short.
# Anything else the environment hands us (POD_NAME and HOSTNAME are unchecked) is made safe:
# a '/' would lead the name out of its folder ("../../x"), a leading dot makes a record look
# like a temporary file that readers skip (prune would not see the pod), and 253 characters
# (what Kubernetes allows) plus ".<pid>.json" and a history prefix pass a file name's 255 bytes.
_PLAIN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_READABLE = 40  # what is kept of an odd name, for ls and locks; the hash tells names apart


def file_safe(name: str) -> str:
    """``name`` as a file name component: itself if plain, else a readable prefix and a hash of the whole.

    ``../../escape`` becomes ``escape-<12 hex>``; two names that differ anywhere differ here too.
    """
    if _PLAIN.fullmatch(name):
        return name
    readable = _UNSAFE.sub("_", name).lstrip("._-")[:_READABLE] or "pod"
    import hashlib  # an odd pod name only: OpenSSL's load is ~2 ms of a pod's start

    digest = hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:12]
    return f"{readable}-{digest}"


class PodIdentity(NamedTuple):
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
        return dict(self._asdict())

    @property
    def file_stem(self) -> str:
        """``<pod>.<pid>`` for the names of this process's files on the volume (pod made safe: file_safe).

        The records themselves hold the whole name (``to_json``).
        """
        return f"{file_safe(self.pod)}.{self.pid}"

    @property
    def record_name(self) -> str:
        return f"{self.file_stem}.json"
