"""The release manifest (tools/releases/manifest.toml), read for every tool and test (standard library only).

A release is named by hand there and nowhere else: tools/oracle/env.sh asks this module for the
wheels and the lock (``python -m cachemgr_testkit.manifest wheels RELEASE``), the oracle's corpus,
identity and derive tools and the tests ask it which releases there are and what each checked.
A release with ``same_code_as`` takes everything but its own wheels from that release.
"""

from __future__ import annotations

import sys
import tomllib
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

REPO = Path(__file__).resolve().parents[2]
MANIFEST = REPO / "tools" / "releases" / "manifest.toml"
OVERRIDES = REPO / "tools" / "releases" / "overrides.toml"
PATHS = ("vllm", "optimum")  # the two model paths: the vLLM-model path, the optimum path
EXIT_UNKNOWN = 64  # env.sh's exit for a release the manifest does not name


class Wheel(NamedTuple):
    name: str
    version: str
    sha256: str


class Release(NamedTuple):
    name: str  # the vllm-rbln version
    vllm: str  # the vLLM vllm-rbln pins, local label included
    optimum_rbln: str
    transformers: str
    compiler: str
    lock: Path
    checked: tuple[str, ...]
    identity: str  # the module derive.py writes: cachemgr/key/<identity>.py
    wheels: tuple[Wheel, ...]
    same_code_as: str | None  # None: the release the oracle ran

    @property
    def oracle(self) -> str:
        """The release whose oracle table and environment stand for this one."""
        return self.same_code_as or self.name

    @property
    def versions(self) -> dict[str, str]:
        """What the pod's package metadata says under this release (cachemgr.key.releases' names)."""
        return {"vllm_rbln": self.name, "optimum_rbln": self.optimum_rbln, "vllm": self.vllm}


@cache
def _raw() -> dict[str, Any]:
    with MANIFEST.open("rb") as handle:
        data: dict[str, Any] = tomllib.load(handle)["releases"]
    return data


def names() -> tuple[str, ...]:
    """Every release of the manifest, in its order."""
    return tuple(_raw())


def oracle_releases() -> tuple[str, ...]:
    """The releases the oracle runs (each has a table); code-identical ones share theirs."""
    return tuple(name for name in names() if "same_code_as" not in _raw()[name])


@cache
def release(name: str) -> Release:
    raw = _raw()
    if name not in raw:
        raise KeyError(f"{name} is not a release of {MANIFEST.relative_to(REPO)} (known: {', '.join(raw)})")
    entry = raw[name]
    own = tuple(Wheel(w["name"], w["version"], w["sha256"]) for w in entry["wheels"])
    base_name = entry.get("same_code_as")
    if base_name is not None:
        base = release(base_name)
        if base.same_code_as is not None:
            raise ValueError(f"{name}: same_code_as {base_name}, which is itself a copy")
        names_own = {w.name for w in own}
        wheels = own + tuple(w for w in base.wheels if w.name not in names_own)
        return base._replace(name=name, wheels=wheels, same_code_as=base_name)
    return Release(
        name=name,
        vllm=entry["vllm"],
        optimum_rbln=entry["optimum_rbln"],
        transformers=entry["transformers"],
        compiler=entry["compiler"],
        lock=REPO / entry["lock"],
        checked=tuple(p for p in PATHS if p in entry["checked"]),
        identity=entry["identity"],
        wheels=own,
        same_code_as=None,
    )


def main(argv: list[str]) -> int:
    """``wheels RELEASE``: one ``name==version sha256`` a line; ``lock RELEASE``: the lock's path."""
    if len(argv) != 2 or argv[0] not in ("wheels", "lock", "names"):
        print("usage: python -m cachemgr_testkit.manifest {wheels,lock} RELEASE | names -", file=sys.stderr)
        return 64
    if argv[0] == "names":
        print(" ".join(names()))
        return 0
    try:
        found = release(argv[1])
    except KeyError as error:
        print(f"{error.args[0]}", file=sys.stderr)
        return EXIT_UNKNOWN
    if argv[0] == "lock":
        print(found.lock)
    else:
        for wheel in found.wheels:
            print(f"{wheel.name}=={wheel.version} {wheel.sha256}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
