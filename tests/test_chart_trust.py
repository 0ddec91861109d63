"""The chart's trust modes, rendered by the real Helm 4: which pods trust, sign and mount what.

docs/design.md ("The threat model") names three modes: open (no keys), signed (keys, the volume
read-write to the serving pods) and builder (keys, serving read-only, the warm Jobs the only
writers). With ``trust.trustedKeys`` set, the builder mode is the default (``readOnlyServing:
auto``); the signed mode is an explicit ``false``. The NOTES say which mode a release runs in and
what it stops. The builder mode's mounts run for real in tests/test_deploy_modes.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.helm import TEST_IMAGE, install_notes
from cachemgr_testkit.kube import by_kind, container, merge, pod_spec, render

from cachemgr.core.signing import parse_trusted_keys

ROOT = Path(__file__).parents[1]
WARM = {"prefill": {"warm": True}, "decode": {"warm": True}}
# A real public key, as `cachemgr keys generate --name builder-1` printed it (32 bytes).
TRUSTED = ["builder-1:7Hy+1Hr7O+3xKVnKafnKcp/iKblqbVBadtH1dbt3xnY="]
KEYS = merge(
    WARM, {"trust": {"trustedKeys": TRUSTED, "signingKeySecret": {"name": "modelserver-signing-key"}}}
)
MODES: dict[str, dict[str, Any]] = {
    "open": WARM,
    "builder by default": KEYS,
    "builder": merge(KEYS, {"trust": {"readOnlyServing": True}}),
    "signed": merge(KEYS, {"trust": {"readOnlyServing": False}}),
    "read-only open": merge(WARM, {"trust": {"readOnlyServing": True}}),
}
CACHE = "/var/cache/cachemgr"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("chart-trust")


def env_of(doc: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container(doc)["env"] if "value" in e}


def cache_mounts(doc: dict[str, Any]) -> list[dict[str, Any]]:
    return [m for m in container(doc)["volumeMounts"] if m["name"] == "compile-cache"]


def cache_volume(doc: dict[str, Any]) -> dict[str, Any]:
    (volume,) = [v for v in pod_spec(doc)["volumes"] if "persistentVolumeClaim" in v]
    return volume


@pytest.mark.parametrize("mode", list(MODES))
def test_trusted_keys_make_serving_read_only_unless_opted_out(mode: str, work: Path) -> None:
    docs = render(work, MODES[mode])
    read_only = mode in ("builder by default", "builder", "read-only open")
    for deployment in by_kind(docs, "Deployment"):
        (root, *_) = cache_mounts(deployment)
        assert root["mountPath"] == CACHE
        assert bool(root.get("readOnly")) is read_only, mode
    for job in by_kind(docs, "Job"):
        assert [m.get("readOnly") for m in cache_mounts(job)] == [None], "the builder writes the cache"


def test_read_only_serving_is_one_volume_mounted_twice(work: Path) -> None:
    """Issue 32, item 7: read-only at the root and read-write at usage/ through a subPath, of ONE
    volume: not the claim as two volumes with two readOnly settings. The volume source says
    readOnly only when no mount of it writes (it would force every mount read-only)."""
    for values, record_use in ((KEYS, True), (merge(KEYS, {"trust": {"recordUse": False}}), False)):
        for deployment in by_kind(render(work, values), "Deployment"):
            claims = [v for v in pod_spec(deployment)["volumes"] if "persistentVolumeClaim" in v]
            assert len(claims) == 1, claims
            (volume,) = claims
            expected = [{"name": "compile-cache", "mountPath": CACHE, "readOnly": True}]
            if record_use:
                expected.append({"name": "compile-cache", "mountPath": f"{CACHE}/usage", "subPath": "usage"})
            assert cache_mounts(deployment) == expected
            claim = volume["persistentVolumeClaim"]
            assert (
                claim["claimName"]
                == f"modelserver-{deployment['metadata']['name'].split('-')[-1]}-compile-cache"
            )
            assert claim.get("readOnly") is (None if record_use else True), claim


def test_the_trust_values_reach_the_pods_that_need_them(work: Path) -> None:
    """Issue 22's stable names: CACHEMGR_TRUSTED_KEYS (serving pods, builders, toolboxes),
    CACHEMGR_SIGNING_KEY_FILE (the builder alone, from a Secret, mode 0400)."""
    for doc in [*by_kind(render(work, WARM), "Deployment"), *by_kind(render(work, WARM), "Job")]:
        assert not {"CACHEMGR_TRUSTED_KEYS", "CACHEMGR_SIGNING_KEY_FILE"} & set(env_of(doc))
    docs = render(work, merge(KEYS, {"toolbox": {"enabled": True}}))
    for deployment in by_kind(docs, "Deployment"):
        env = env_of(deployment)
        assert env["CACHEMGR_TRUSTED_KEYS"] == " ".join(TRUSTED)
        assert parse_trusted_keys(env["CACHEMGR_TRUSTED_KEYS"]).names == ("builder-1",)
        assert "CACHEMGR_SIGNING_KEY_FILE" not in env, "serving pods and toolboxes never hold the signing key"
        assert "signing-key" not in {v["name"] for v in pod_spec(deployment)["volumes"]}
    for job in by_kind(docs, "Job"):
        env = env_of(job)
        assert env["CACHEMGR_TRUSTED_KEYS"] == " ".join(TRUSTED)
        mounts = {m["name"]: m for m in container(job)["volumeMounts"]}
        secret = {v["name"]: v for v in pod_spec(job)["volumes"]}["signing-key"]["secret"]
        assert secret["secretName"] == "modelserver-signing-key"
        assert env["CACHEMGR_SIGNING_KEY_FILE"] == str(
            Path(mounts["signing-key"]["mountPath"]) / secret["items"][0]["path"]
        )
        assert mounts["signing-key"]["readOnly"] is True
        assert secret["defaultMode"] == 0o400


# --- the NOTES: which mode, and which threat it stops ----------------------------------------------

# Each mode's claims, and where docs/design.md's threat model makes them (its words, whitespace-blind).
CLAIMS: dict[str, list[tuple[str, str]]] = {
    "open": [
        ("Trust: the open mode", "Open: no keys."),
        ("whoever can write the volume can change one", "every entry: code in every pod that loads it next"),
    ],
    "builder": [
        (
            "Trust: the builder mode",
            "Builder: a builder signs; the serving pods trust and mount the volume read-only",
        ),
        (
            "adding files to a warm Job's staging while it compiles",
            "Only the builder mode, with the builder the volume's only writer, closes that.",
        ),
        (
            "changing a file between a pod's check and its server's read",
            "a change between the content check and the server's read",
        ),
        ("anything else that mounts the PVC read-write", "anything else that mounts the volume read-write"),
        (
            "use records in usage/",
            "use records in `usage/` (keeping entries from prune) and the volume's free space",
        ),
    ],
    "signed": [
        ("Trust: the signed mode", "Signed: trusted keys, the volume read-write to the serving pods"),
        ("a changed or forged entry is never loaded", "a changed or forged entry is untrusted"),
        (
            "can add files to a warm Job's staging while it compiles",
            "what they add to a signer's staging while it compiles",
        ),
        (
            "change a file between a pod's check and its server's read",
            "a change between the content check and the server's read",
        ),
    ],
}


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("mode", list(CLAIMS))
def test_the_notes_say_which_threat_the_mode_stops(mode: str, work: Path) -> None:
    values = {"open": WARM, "builder": KEYS, "signed": MODES["signed"]}[mode]
    notes = flat(install_notes(merge(TEST_IMAGE, values), work=work))
    design = flat((ROOT / "docs" / "design.md").read_text())
    design = design[design.index("### The threat model") : design.index("## The lease")]
    for said, source in CLAIMS[mode]:
        assert said in notes, f"the NOTES no longer say: {said}"
        assert source in design, f"the threat model no longer says: {source}"
    others = {m for m in CLAIMS if m != mode}
    for other in others:
        assert f"Trust: the {other} mode" not in notes
