"""cachemgr's side of the key oracle: its key of every variant against the server's answers.

``python -m cachemgr_testkit.oracle_keys TABLE`` prints the verdicts of a table (tests/data/oracle/,
written by scripts/oracle: the corpus with the server's answer to each variant) and exits 1 when
cachemgr has a false hit or needless misses of 5 % or more. tests/test_oracle.py holds the same in
CI. Each variant's model directory is laid out as the oracle laid it out, at one path for the
variant and its reference (vllm-rbln keys the path string, so an edit happens in place).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.key.cachekey import KeyRequest, compute_key
from cachemgr_testkit import manifest, oracle

# What the oracle's image holds, as cachemgr reads it (its CACHEMGR_* variables stand for the
# packages' metadata here): the release the table was made with, per release of the manifest.
VERSIONS = {
    name: {
        "CACHEMGR_VLLM_VERSION": release.vllm,
        "CACHEMGR_VLLM_RBLN_VERSION": name,
        "CACHEMGR_OPTIMUM_RBLN_VERSION": release.optimum_rbln,
        "CACHEMGR_TRANSFORMERS_VERSION": release.transformers,
    }
    for name, release in ((n, manifest.release(n)) for n in manifest.names())
}
NEEDLESS_LIMIT = 0.05


def load(path: Path) -> dict[str, Any]:
    table: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return table


def replay(table: Mapping[str, Any], workdir: Path, *, as_release: str | None = None) -> list[dict[str, Any]]:
    """Every variant's verdict: cachemgr's keys of it and of its reference, against the answer; keyed
    under ``as_release``'s versions if given (a release whose code is the table's: the same answers)."""
    variants = {v["id"]: v for v in table["variants"]}
    release = table["release"]
    versions = VERSIONS[as_release or release]
    empty = workdir / "no-devices"
    empty.mkdir(exist_ok=True)
    base_model = oracle.materialize(workdir / "models" / "base")
    keys: dict[str, str | None] = {}
    rows = []
    for vid, variant in variants.items():
        if variant.get("model"):
            path = workdir / "models" / "edited"
            ref = variants[variant["ref"]] if variant.get("ref") else {"base": variant["base"]}
            ref_key = _key(
                ref,
                oracle.materialize(path, ref.get("model", ())),
                release,
                workdir,
                empty,
                versions=versions,
            )
            mine = _key(
                variant,
                oracle.materialize(path, variant["model"]),
                release,
                workdir,
                empty,
                versions=versions,
            )
        else:
            ref_id = variant.get("ref") or f"base:{variant['base']}"
            if ref_id not in keys:
                ref = variants.get(ref_id) or {"base": variant["base"]}
                keys[ref_id] = _key(ref, base_model, release, workdir, empty, versions=versions)
            ref_key = keys[ref_id]
            mine = _key(variant, base_model, release, workdir, empty, versions=versions)
        equal = None if mine is None or ref_key is None else mine == ref_key
        rows.append(
            {
                "id": vid,
                "verdict": oracle.verdict(variant["answer"], equal),
                "differs": variant["answer"].get("differs", []),
            }
        )
    return rows


def _key(
    variant: Mapping[str, Any],
    model: Path,
    release: str,
    workdir: Path,
    no_devices: Path,
    *,
    versions: Mapping[str, str],
) -> str | None:
    image = oracle.image_of(variant, release)
    environ = {
        "HOME": str(workdir / "home"),
        "HF_HUB_OFFLINE": "1",
        "CACHEMGR_RBLN_DEV_DIR": str(no_devices),  # no device answers, as in the oracle
        "CACHEMGR_COMPILER_VERSION": image["compiler"],
        **versions,
        **oracle.env_of(variant, str(model), release),
    }
    request = KeyRequest(argv=oracle.argv_of(variant, str(model), release), role="prefill", environ=environ)
    try:
        return compute_key(request).digest
    except (ConfigError, UsageError):
        return None  # cachemgr refuses it (64 or 78): no key, no entry


def describe(rows: Sequence[Mapping[str, Any]]) -> str:
    result = oracle.report(rows)
    by_id = {r["id"]: r for r in rows}
    lines = [
        f"{result['variants']} variants, {result['judged']} judged (the server refuses the rest)",
        "verdicts: " + ", ".join(f"{k} {v}" for k, v in result["counts"].items()),
        f"needless misses: {result['needless_share']:.1%} of the judged (limit {NEEDLESS_LIMIT:.0%})",
    ]
    for title, ids in (("false hits", result["false_hits"]), ("needless misses", result["needless_misses"]),
                       ("cachemgr refuses", result["cachemgr_refuses"])):  # fmt: skip
        if ids:
            lines.append(f"{title}:")
            lines += [f"  {vid}  [{', '.join(by_id[vid]['differs']) or 'same'}]" for vid in ids]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("table", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cachemgr-oracle-keys-") as tmp:
        rows = replay(load(args.table), Path(tmp))
    print(describe(rows))
    result = oracle.report(rows)
    return 1 if result["false_hits"] or result["needless_share"] >= NEEDLESS_LIMIT else 0


if __name__ == "__main__":
    sys.exit(main())
