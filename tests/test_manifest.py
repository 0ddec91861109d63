"""The check a hit passes: ``check_files`` against real published trees, damaged on purpose."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from cachemgr_testkit.scenarios import command_key

from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.manifest import ManifestError, Problem, check_files, parse_manifest, read_manifest
from cachemgr.volume.store import create_staging, publish

pytestmark = pytest.mark.quick  # unit tests: no process, mount or server (conftest checks)

FILES = {
    "graph_0.rbln": 4096,
    "layers/0/attn.rbln": 3000,
    "layers/0/mlp.rbln": 1,
    "layers/1/attn.rbln": 0,
    "layers/1/deep/er/weights.bin": 70_000,
}


@pytest.fixture
def entry(tmp_path: Path) -> Path:
    """A published entry with nested directories, through the real publish path."""
    (tmp_path / "volume").mkdir()
    root = open_root(tmp_path / "volume", create=True)
    key = command_key("decode")
    identity = PodIdentity(pod="test", node="node-a", host="test", pid=os.getpid())
    staging = create_staging(root, key, identity)
    for rel, size in FILES.items():
        path = staging.artifacts / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(os.urandom(size))
    outcome = publish(root, staging, key, identity=identity, compile_seconds=1.0, strategy="command")
    for dirpath, dirs, files in os.walk(outcome.path):  # published read-only: let the tests damage it
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o644)
        for name in dirs:
            os.chmod(os.path.join(dirpath, name), 0o755)
    return outcome.path


def _check(entry: Path, mode: str = "fast") -> list[Problem]:
    return check_files(entry, read_manifest(entry), mode=mode)  # type: ignore[arg-type]


def _what(problems: list[Problem]) -> dict[str, str]:
    return {problem.path.removeprefix("artifacts/"): problem.what for problem in problems}


def test_an_intact_entry_passes_both_checks(entry: Path) -> None:
    assert _check(entry, "fast") == []
    assert _check(entry, "full") == []


def test_a_missing_directory_makes_each_of_its_files_missing(entry: Path) -> None:
    shutil.rmtree(entry / "artifacts" / "layers" / "1")
    assert _what(_check(entry)) == {
        "layers/1/attn.rbln": "missing",
        "layers/1/deep/er/weights.bin": "missing",
    }


def test_a_truncated_file_fails_the_fast_check(entry: Path) -> None:
    os.truncate(entry / "artifacts" / "layers" / "0" / "attn.rbln", 100)
    assert _what(_check(entry)) == {"layers/0/attn.rbln": "size 100 bytes, manifest says 3000"}


def test_a_flipped_byte_fails_the_fast_check_by_its_mtime(entry: Path) -> None:
    path = entry / "artifacts" / "layers" / "1" / "deep" / "er" / "weights.bin"
    data = bytearray(path.read_bytes())
    data[12345] ^= 0xFF
    path.write_bytes(bytes(data))
    assert _what(_check(entry, "fast")) == {
        "layers/1/deep/er/weights.bin": "modified after it was published (its mtime changed)"
    }


def test_a_flipped_byte_with_its_mtime_put_back_passes_the_fast_check_and_fails_the_full_one(
    entry: Path,
) -> None:
    path = entry / "artifacts" / "layers" / "1" / "deep" / "er" / "weights.bin"
    before = path.stat()
    data = bytearray(path.read_bytes())
    data[12345] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))  # as a careful tamperer would
    assert _check(entry, "fast") == []
    assert _what(_check(entry, "full")) == {
        "layers/1/deep/er/weights.bin": "content differs from the manifest's xxh3-128"
    }


def test_a_file_replaced_by_a_symlink_or_a_directory_is_not_taken_for_it(entry: Path) -> None:
    artifacts = entry / "artifacts"
    (artifacts / "graph_0.rbln").unlink()
    (artifacts / "graph_0.rbln").symlink_to(artifacts / "layers" / "1" / "deep" / "er" / "weights.bin")
    (artifacts / "layers" / "1" / "attn.rbln").unlink()
    (artifacts / "layers" / "1" / "attn.rbln").mkdir()
    (artifacts / "layers" / "1" / "attn.rbln" / "pad").write_bytes(b"x" * 5000)
    assert _what(_check(entry, "fast")) == {
        "graph_0.rbln": "not a regular file",
        "layers/1/attn.rbln": "not a regular file",
    }


def test_a_directory_where_a_directory_of_files_was_expected_is_a_file(entry: Path) -> None:
    shutil.rmtree(entry / "artifacts" / "layers" / "0")
    (entry / "artifacts" / "layers" / "0").write_bytes(b"not a directory")
    assert _what(_check(entry)) == {"layers/0/attn.rbln": "missing", "layers/0/mlp.rbln": "missing"}


def test_files_the_manifest_does_not_name_are_left_alone(entry: Path) -> None:
    (entry / "artifacts" / "layers" / "0" / "extra.log").write_text("a server's own write")
    assert _check(entry, "full") == []


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("artifacts//x", "not a plain relative path"),
        ("artifacts/./x", "not a plain relative path"),
        ("artifacts/x/", "not a plain relative path"),
        ("artifacts/x\0y", "not a plain relative path"),
        ("artifacts/x\ud800", "not a plain relative path"),
        ("artifacts/../x", "leaves the entry"),
        ("/artifacts/x", "leaves the entry"),
        ("artifacts/graph_0.rbln", "listed twice"),
    ],
)
def test_a_manifest_path_not_spelled_as_publish_writes_it_is_refused(
    entry: Path, path: str, why: str
) -> None:
    """Only the spelling build_manifest writes is read (the path a view's link is made from)."""
    data = json.loads((entry / "manifest.json").read_bytes())
    data["files"].append({"path": path, "size": 1, "xxh3": "0" * 32})
    with pytest.raises(ManifestError, match=why):
        parse_manifest(json.dumps(data).encode(), path=entry / "manifest.json")
    assert parse_manifest((entry / "manifest.json").read_bytes(), path=entry / "manifest.json").files
