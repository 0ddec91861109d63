"""One published entry as a scan of the volume sees it (cachemgr.ops.scan): its summary, its
generation, its users, and its status."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from cachemgr.core.units import human_age, human_bytes
from cachemgr.ops.generation import Generation, KeyFacts, Order
from cachemgr.volume.records import Mark, User

# What the scan checked, and no more: ``published`` (its summary reads, its manifest, the commit
# record written last, is there), ``damaged`` (summary or manifest missing or unreadable), and by
# its generation (cachemgr.ops.generation, from its key.json): ``incompatible`` (an older compiler
# major.minor or key schema than this image's: no pod of this image can ever use it),
# ``superseded`` (an older server than this image's with the same compiler; or, where this image
# cannot order it, older than another entry of its model, role and NPU that is not newer than this
# image: cachemgr.ops.lineage), ``newer`` (a newer image's: never judged dead here). The files themselves are not checked here: ``show`` checks sizes and
# mtimes, ``verify`` hashes them.
EntryStatus = Literal["published", "damaged", "incompatible", "superseded", "newer"]
# The statuses of an older generation than this image's: what prune --incompatible and
# --superseded may remove once no pod uses them.
OLDER = frozenset({"incompatible", "superseded"})


@dataclass(frozen=True)
class EntryInfo:
    """One published entry as the scan sees it."""

    name: str
    path: Path
    key: str
    model: str
    model_id: str
    role: str
    compiler: str
    npu: str
    strategy: str
    size_bytes: int
    files: int
    pipeline_parallel_size: int
    created_at: float | None
    # When a pod last started or stopped using it: the usage folder's mtime changes when a pod
    # registers and when it leaves (the ``last-used`` mark alone is touched only at start, so an
    # entry served for a month would look unused for a month the minute its pods stopped).
    last_used_at: float | None
    users: tuple[User, ...]  # live: fresh by this node's clock, or seen to beat
    status: EntryStatus
    problem: str | None = None
    compile_seconds: float | None = None  # how long its compile took: what an ETA learns from
    # Pod starts that hit this entry and saw the server compile anyway (cachemgr.volume.drift).
    recompiled_on_hit: int = 0
    # Records silent by this node's clock: a dead pod's, or a live one on a node whose clock
    # differs from ours. Not "in use" for ``ls``; ``prune`` observes them before removing.
    silent_users: tuple[User, ...] = ()
    # The usage folder as this scan read it (None: not read): prune removes the entry only
    # while the folder still looks exactly like this (records.Usage.seen).
    usage_seen: frozenset[tuple[str, Mark]] | None = None
    # Where the entry came from: compiled on this volume, or downloaded from the remote tier
    # (summary.json's "origin", written by cachemgr.remote.hooks).
    origin: Mapping[str, Any] = field(default_factory=dict)
    # The key its publisher signed it with: with trusted keys, the one its signature.json names
    # (None: unsigned), else as summary.json claims (not checked); and with trusted keys, whether
    # one of them signed it for this key ("trusted") or why not ("untrusted: ..."); None: not
    # checked. The bytes are checked by pods and ``verify``.
    signer: str | None = None
    trust: str | None = None
    # Pod starts on this entry by how they got it (records.STARTS): its use records, live and ended.
    starts: Mapping[str, int] = field(default_factory=dict)
    # Pre-ready exits of servers launched on this copy of the entry (cachemgr.volume.serverfail).
    server_failed: int = 0
    # What its key.json says (cachemgr.ops.generation): its generation and lineage; None when
    # unknown (missing, damaged, or not this key's): then it is never judged older.
    facts: KeyFacts | None = None
    # Its generation against this image's: same, older, newer, unordered (None: not judged).
    vs_image: Order | None = None
    # The key of the newer entry of its model, role and NPU that supersedes it, if that is why.
    superseded_by: str | None = None

    @property
    def generation(self) -> Generation | None:
        return self.facts.generation if self.facts is not None else None

    @property
    def older(self) -> bool:
        """Of an older generation (incompatible or superseded): prunable once no pod uses it."""
        return self.status in OLDER

    @property
    def hits(self) -> int:
        """Starts that found the entry published and loaded it without compiling or waiting."""
        return int(self.starts.get("hit", 0))

    @property
    def origin_kind(self) -> str:
        return str(self.origin.get("kind") or "local")

    @property
    def in_use(self) -> bool:
        return bool(self.users)

    @property
    def short(self) -> str:
        return (self.key or self.name.rsplit("__", 1)[-1])[:12]

    @property
    def size_str(self) -> str:
        return human_bytes(self.size_bytes)

    @property
    def created_str(self) -> str:
        return human_age(self.created_at)

    @property
    def last_used_str(self) -> str:
        return human_age(self.last_used_at)

    @property
    def users_str(self) -> str:
        return ", ".join(user.pod for user in self.users) or "-"

    def unused_for(self, now: float | None = None) -> float:
        # The usage folder may predate a republished entry (same key): count from the later.
        ref = max(self.last_used_at or 0.0, self.created_at or 0.0)
        return max(0.0, (time.time() if now is None else now) - ref)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "entry",
            "key": self.key,
            "short": self.short,
            "entry": self.name,
            "model": self.model,
            "role": self.role,
            "compiler": self.compiler,
            "npu": self.npu,
            "strategy": self.strategy,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "created_at": self.created_at,
            "last_used_at": self.last_used_at,
            "in_use": self.in_use,
            "users": [user.to_json() for user in self.users],
            "silent_users": [user.to_json() for user in self.silent_users],
            "status": self.status,
            "problem": self.problem,
            "recompiled_on_hit": self.recompiled_on_hit,
            "origin": {"kind": self.origin_kind, **self.origin},
            "signer": self.signer,
            "trust": self.trust,
            "hits": self.hits,
            "starts": dict(self.starts),
            "server_failed": self.server_failed,
            "generation": self.generation.to_json() if self.generation is not None else None,
            "vs_image": self.vs_image,
            "superseded_by": self.superseded_by,
        }
