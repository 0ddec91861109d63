"""tools/oracle/env.sh keeps a venv that holds what the release pins, whatever its stamp says.

The oracle's and the real-server tier's venvs live in one .oracle that several checkouts share
(CACHEMGR_ORACLE_DIR), and servers run from them. The stamp used to be a hash of env.sh's own
text: any edit of the script (9009209 changed how it reads the manifest) made every checkout that
ran it delete the shared venv and build it again (4 minutes), under the feet of whoever used it.
Here the venv is made by hand, without the registry (no index: a rebuild fails at once): the
distributions the lock pins and the three wheels, each with pip's record of the file it came from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RELEASE = "0.11.2"
NO_REGISTRY = {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": ""}


def _dist(site: Path, name: str, version: str, sha: str | None = None) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if sha is not None:
        url = {"url": "file:///w.whl", "archive_info": {"hashes": {"sha256": sha}}}
        (info / "direct_url.json").write_text(json.dumps(url))


def _manifest(what: str) -> list[str]:
    """What tools/oracle/env.sh reads of the manifest (cachemgr_testkit.manifest's command)."""
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr_testkit.manifest", what, RELEASE],
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout.splitlines()


def _venv(root: Path, *, wheel_sha: str | None = None, extra: str | None = None) -> Path:
    venv = root / RELEASE / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    lock = Path(_manifest("lock")[0])
    for raw in lock.read_text().splitlines():
        pin = raw.split("#", 1)[0].strip()
        if pin:
            name, _, version = pin.partition("==")
            _dist(site, name, version)
    for item in _manifest("wheels"):
        spec, _, sha = item.partition(" ")
        name, _, version = spec.partition("==")
        _dist(site, name, version, wheel_sha or sha)
    if extra:
        _dist(site, extra, "1.0")
    (venv / ".cachemgr-oracle-stamp").write_text("a stamp of another revision of env.sh\n")
    (venv / "kept").write_text("")
    return venv


def _env_sh(root: Path, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "CACHEMGR_ORACLE_DIR": str(root), **NO_REGISTRY}
    return subprocess.run(
        ["bash", str(REPO / "tools" / "oracle" / "env.sh"), RELEASE],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_a_venv_holding_what_the_release_pins_is_kept_whatever_its_stamp(tmp_path: Path) -> None:
    venv = _venv(tmp_path / "oracle")
    # From the checkout's root, where its own *.egg-info lies: not a distribution of the venv.
    done = _env_sh(tmp_path / "oracle", REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(venv / "bin" / "python")
    assert "building" not in done.stderr
    assert (venv / "kept").exists()
    assert (venv / ".cachemgr-oracle-stamp").read_text() == "a stamp of another revision of env.sh\n"


@pytest.mark.parametrize("fault", ["a wheel from another file", "a package the lock does not pin"])
def test_a_venv_holding_anything_else_is_built_again(tmp_path: Path, fault: str) -> None:
    if fault == "a wheel from another file":
        venv = _venv(tmp_path / "oracle", wheel_sha="0" * 64)
    else:
        venv = _venv(tmp_path / "oracle", extra="stray-package")
    done = _env_sh(tmp_path / "oracle", tmp_path)
    # The registry is out of reach here: the rebuild starts (the venv is gone) and fails.
    assert "building the oracle environment" in done.stderr
    assert done.returncode != 0
    assert not (venv / "kept").exists()
