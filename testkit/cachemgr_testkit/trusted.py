"""What the trust tests do to entries: keys, forgeries, files changed behind the fast check, and
the canary pickle of the stand-in's ``torch_artifacts.pth``.

Every forgery is what a writer of the volume (or the bucket) can really do: entries are published
0444/0555, and their owner (or root, as these tests run) changes them anyway.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
from pathlib import Path
from typing import Any

from cachemgr.core.signing import SecretKey, generate_secret_key
from cachemgr.volume.manifest import build_manifest, read_manifest, write_manifest
from cachemgr.volume.trust import SIGNATURE_NAME


def new_key(folder: Path, name: str) -> tuple[SecretKey, Path]:
    """A fresh key pair: the secret and the file it is in (mode 0600)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.key"
    return generate_secret_key(name, path), path


def writable(entry: Path) -> None:
    """What a writer does first: a published entry is 0444/0555, its owner makes it writable again
    (a link in it is left alone: chmod would change its target, which may lie outside)."""
    os.chmod(entry, 0o755)
    for folder, dirs, files in os.walk(entry):
        for name in (*dirs, *files):
            path = os.path.join(folder, name)
            if not os.path.islink(path):
                os.chmod(path, 0o755 if name in dirs else 0o644)


def artifact_files(entry: Path) -> list[Path]:
    """The entry's artifact files, sorted (the ``.rbln`` graphs first in the stand-in's layout)."""
    return sorted(
        (p for p in (entry / "artifacts").rglob("*") if p.is_file()),
        key=lambda p: (p.suffix != ".rbln", str(p)),
    )


def change_keeping_size_and_mtime(path: Path, *, old: bytes = b"", new: bytes = b"") -> None:
    """Other bytes, same size, the mtime put back: what the fast check (size, mtime) cannot see.
    A byte in the middle flipped, or ``old`` replaced by ``new`` of its length (a readable edit)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    if old:
        if len(old) != len(new) or old not in data:
            raise ValueError(f"cannot replace {old!r} by {new!r} in {path} keeping its size")
        data = bytearray(bytes(data).replace(old, new))
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def rebuild_manifest(entry: Path, *, with_blake3: bool = True) -> None:
    """A self-consistent manifest of what the entry holds now, as a writer without the key makes
    one: every size, mtime, xxh3 (and BLAKE3) right; only a signature can tell."""
    old = read_manifest(entry)
    (entry / "manifest.json").unlink()
    manifest = build_manifest(
        entry,
        key=old.key,
        inputs=old.inputs,
        created_by=dict(old.created_by),
        compile_seconds=old.compile_seconds,
        strategy=old.strategy,
        model_name=old.model_name,
        extra=dict(old.extra),
        blake3=with_blake3,
    )
    write_manifest(entry, manifest)


def forge_unsigned(entry: Path) -> None:
    """The entry rewritten by someone without the key: other bytes, no signature, a manifest that
    is right about them (the right name, and a fast and a full check both pass)."""
    writable(entry)
    (entry / SIGNATURE_NAME).unlink(missing_ok=True)
    target = artifact_files(entry)[0]
    target.write_bytes(target.read_bytes()[::-1])
    rebuild_manifest(entry)


def forge_keeping_signature(entry: Path) -> None:
    """Other bytes under the publisher's signature: the manifest re-hashed to match them."""
    writable(entry)
    target = artifact_files(entry)[0]
    target.write_bytes(target.read_bytes()[::-1])
    rebuild_manifest(entry)


class _Canary:
    """Unpickles into ``open(path, "w")``: a file appears wherever the pickle is loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (builtins.open, (str(self.path), "w"))


def plant_canary(entry: Path, canary: Path) -> Path:
    """optimum-rbln's risk, planted: a ``torch_artifacts.pth`` whose unpickling creates ``canary``
    beside the compiled model's ``rbln_config.json``, which now asks for it (``use_inputs_embeds``),
    and a manifest that lists it (the open mode's checks pass). The compiled directory."""
    writable(entry)
    config_path = next((entry / "artifacts").rglob("rbln_config.json"))
    config = json.loads(config_path.read_text())
    config["use_inputs_embeds"] = True
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (config_path.parent / "torch_artifacts.pth").write_bytes(pickle.dumps(_Canary(canary)))
    rebuild_manifest(entry)
    return config_path.parent
