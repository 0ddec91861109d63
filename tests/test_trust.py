"""Only what a trusted publisher built (issue 22): signed entries, trusting pods, the read-only mode.

The library tests publish by library call and judge entries as a trusting pod does; the pod tests
run real ``cachemgr run``/``warm`` processes against the stand-in, whose server unpickles a
``torch_artifacts.pth`` as optimum-rbln does (the canary). Forgeries are real writes into the
entry, as anyone who can write the volume makes them (cachemgr_testkit.trusted).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.mounts import writable_bind
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli
from cachemgr_testkit.scenarios import (
    assert_clean_after_failure,
    command_key,
    compile_cmd,
    compiles,
    entry_dirs,
    server_argv,
    tree_state,
    vllm_argv,
)
from cachemgr_testkit.trusted import (
    artifact_files,
    change_keeping_size_and_mtime,
    forge_keeping_signature,
    forge_unsigned,
    new_key,
    plant_canary,
    rebuild_manifest,
    writable,
)

from cachemgr.core.signing import SecretKey, TrustedKeys, parse_trusted_keys
from cachemgr.key.cachekey import CacheKey
from cachemgr.ops.explain import explain
from cachemgr.ops.inspection import list_cache, show
from cachemgr.ops.prune_plan import PruneRequest, plan_prune
from cachemgr.ops.scan import scan
from cachemgr.ops.verify import verify
from cachemgr.volume.contentcheck import Expected, first_problem
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import CacheRoot, open_root
from cachemgr.volume.manifest import read_manifest
from cachemgr.volume.store import create_staging, lookup, publish
from cachemgr.volume.trust import SIGNATURE_NAME

IDENTITY = PodIdentity(pod="builder", node="node-a", host="test", pid=os.getpid())


def _trusting(*keys: SecretKey) -> TrustedKeys:
    return parse_trusted_keys(" ".join(str(k.public) for k in keys))


def _volume(tmp_path: Path) -> CacheRoot:
    (tmp_path / "volume").mkdir(parents=True)
    return open_root(tmp_path / "volume", create=True)


def _publish(
    root: CacheRoot, key: CacheKey, signer: SecretKey | None, *, extra: tuple[str, ...] = ()
) -> Path:
    staging = create_staging(root, key, IDENTITY)
    (staging.artifacts / "sub").mkdir()
    files = ["graph_0.rbln", "sub/graph_1.rbln", "sub/graph_2.rbln", "rbln_config.json", *extra]
    for i, rel in enumerate(files):
        (staging.artifacts / rel).parent.mkdir(parents=True, exist_ok=True)
        (staging.artifacts / rel).write_bytes(os.urandom(8192 + i))
    outcome = publish(
        root, staging, key, identity=IDENTITY, compile_seconds=1.0, strategy="command", signer=signer
    )
    assert outcome.published
    return outcome.path


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, SecretKey]:
    return {name: new_key(tmp_path / "keys", name)[0] for name in ("builder-1", "builder-2", "other-1")}


# --- the library: publish signs, lookup judges -------------------------------------------------


@pytest.mark.quick
def test_a_signed_entry_is_a_trusted_hit_and_names_its_signer(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, keys["builder-1"])
    manifest = read_manifest(entry)
    assert all(r.blake3 for r in manifest.files if r.path.startswith("artifacts/"))
    assert SIGNATURE_NAME in {r.path for r in manifest.files}, "the signature travels with the entry"
    found = lookup(root, key, trusted=_trusting(keys["builder-1"]))
    assert (found.status, found.signer) == ("hit", "builder-1")
    assert lookup(root, key).status == "hit", "the open mode takes it as any entry"
    summary = json.loads((entry / "summary.json").read_text())
    assert summary["signer"] == "builder-1"


@pytest.mark.quick
def test_an_unsigned_entry_is_unchanged_from_the_open_mode(tmp_path: Path) -> None:
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, None)
    manifest = read_manifest(entry)
    assert not (entry / SIGNATURE_NAME).exists()
    assert all(r.blake3 is None for r in manifest.files)
    assert "blake3" not in (entry / "manifest.json").read_text(), "no new fields in the open mode's manifest"
    assert "signer" not in json.loads((entry / "summary.json").read_text())


def _reason(root: CacheRoot, key: CacheKey, trusted: TrustedKeys) -> str:
    found = lookup(root, key, trusted=trusted)
    assert found.status == "untrusted", found
    return found.untrusted


@pytest.mark.quick
def test_every_forgery_is_untrusted_with_its_reason(tmp_path: Path, keys: dict[str, SecretKey]) -> None:
    trusted = _trusting(keys["builder-1"])
    cases: dict[str, str] = {}
    for name, forge in {
        "unsigned": forge_unsigned,
        "kept-signature": forge_keeping_signature,
        "size-and-mtime-put-back": lambda e: change_keeping_size_and_mtime(artifact_files(e)[1]),
    }.items():
        root, key = _volume(tmp_path / name), command_key()
        entry = _publish(root, key, keys["builder-1"])
        forge(entry)
        assert lookup(root, key).status == "hit", f"{name}: the open mode cannot tell"
        cases[name] = _reason(root, key, trusted)
    assert cases["unsigned"] == "untrusted: unsigned"
    assert cases["kept-signature"].startswith("untrusted: the manifest's files are not the signed ones")
    assert cases["size-and-mtime-put-back"] == (
        "untrusted: artifacts/sub/graph_1.rbln changed after signing (its bytes differ from the signed BLAKE3)"
    )


@pytest.mark.quick
def test_another_key_a_forged_signature_and_another_keys_statement_are_untrusted(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    trusted = _trusting(keys["builder-1"])
    root, key = _volume(tmp_path / "other"), command_key()
    _publish(root, key, keys["other-1"])
    assert _reason(root, key, trusted) == "untrusted: key other-1"

    # A signature by another key, relabelled with the trusted key's name: it does not verify.
    root, key = _volume(tmp_path / "relabelled"), command_key()
    entry = _publish(root, key, keys["other-1"])
    writable(entry)
    doc = json.loads((entry / SIGNATURE_NAME).read_text())
    doc["key"] = "builder-1"
    doc["statement"] = doc["statement"].replace('"signer":"other-1"', '"signer":"builder-1"')
    (entry / SIGNATURE_NAME).write_text(json.dumps(doc))
    rebuild_manifest(entry)
    assert "the signature by key builder-1 does not verify" in _reason(root, key, trusted)

    # A real signature of another key's entry, copied over: signed for another key.
    root, key = _volume(tmp_path / "replayed"), command_key()
    decode = command_key("decode")
    entry = _publish(root, key, None)
    donor = _publish(root, decode, keys["builder-1"])
    writable(entry)
    (entry / SIGNATURE_NAME).write_bytes((donor / SIGNATURE_NAME).read_bytes())
    rebuild_manifest(entry)
    assert _reason(root, key, trusted).startswith("untrusted: signed for another key")


@pytest.mark.quick
@pytest.mark.parametrize(
    "garbage",
    [b"", b"{", b'{"format": 1}', b"[1, 2]", b'{"format":1,"statement":"x","key":"k","signature":"!!"}'],
)
def test_a_signature_that_does_not_parse_is_untrusted_never_an_exit(
    tmp_path: Path, keys: dict[str, SecretKey], garbage: bytes
) -> None:
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, keys["builder-1"])
    writable(entry)
    (entry / SIGNATURE_NAME).write_bytes(garbage)
    rebuild_manifest(entry)
    assert _reason(root, key, _trusting(keys["builder-1"])).startswith(
        "untrusted: signature.json does not parse"
    )


_PLANTED = "\x1b[2J\x1b[31mPLANTED\nsecond line" + "A" * 300


def _plant(doc: dict[str, Any], statement: dict[str, Any], where: str) -> None:
    """One field of a real signature (or its statement) set to what a hostile writer chooses."""
    field, _, value = where.partition("=")
    target, name = (statement, field[len("statement.") :]) if field.startswith("statement.") else (doc, field)
    target[name] = _PLANTED if value == "planted" else json.loads(value)


@pytest.mark.quick
@pytest.mark.parametrize(
    "where",
    ["key=planted", "format=planted", "signature=planted", "statement.signer=planted",
     "statement.signed_at=planted", 'statement.signed_at="nan"', 'statement.files="3"',
     "statement.built_by=planted", "statement.list=planted"],
)  # fmt: skip
def test_a_planted_signature_field_is_untrusted_and_never_repeated(
    tmp_path: Path, keys: dict[str, SecretKey], where: str
) -> None:
    """What a writer of the volume or the bucket puts in signature.json reaches logs, tables and
    quarantine notes only as one of our own fixed reasons: no escape, no newline, no length."""
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, keys["builder-1"])
    writable(entry)
    doc = json.loads((entry / SIGNATURE_NAME).read_text())
    statement = json.loads(doc["statement"])
    _plant(doc, statement, where)
    doc["statement"] = json.dumps(statement)
    (entry / SIGNATURE_NAME).write_text(json.dumps(doc))
    rebuild_manifest(entry)
    found = lookup(root, key, trusted=_trusting(keys["builder-1"]))
    assert found.status == "untrusted"
    assert found.untrusted.startswith("untrusted: signature.json does not parse ("), found.untrusted
    for said in (found.untrusted, str(show(root, key.short, compat=None).signature)):
        assert not [mark for mark in ("PLANTED", "x1b", "AAAA") if mark in said], said
        assert said.isprintable(), said
        assert len(said) < 120, said
    assert found.signer is None, "a signature that does not parse names no signer"


@pytest.mark.quick
def test_a_symlink_in_place_of_the_signature_is_damage_and_a_fifo_never_blocks_the_check(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    trusted = _trusting(keys["builder-1"])
    root, key = _volume(tmp_path / "sig"), command_key()
    entry = _publish(root, key, keys["builder-1"])
    writable(entry)
    outside = tmp_path / "outside.json"
    outside.write_bytes((entry / SIGNATURE_NAME).read_bytes())
    (entry / SIGNATURE_NAME).unlink()
    (entry / SIGNATURE_NAME).symlink_to(outside)
    assert lookup(root, key, trusted=trusted).status == "damaged", "a link in an entry is damage"

    os.mkfifo(entry / "artifacts" / "fifo")  # a FIFO must not block the check
    found = first_problem(root.path, entry, [Expected("artifacts/fifo", 0, "0" * 64)])
    assert found is not None
    assert "not a regular file" in found.what


# As root (CAP_DAC_OVERRIDE) modes mean nothing: drop every capability, so the lookup runs as an
# unprivileged owner of the volume's files would (the chart's runAsUser).
_UNPRIVILEGED = ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all", "--"] if os.geteuid() == 0 else []
_LOOKUP = """
import json, sys
from pathlib import Path
from cachemgr.core.signing import parse_trusted_keys
from cachemgr.volume.layout import open_root
from cachemgr.volume.store import lookup
from cachemgr_testkit.scenarios import command_key
root, keys = open_root(Path(sys.argv[1]), create=False), sys.argv[2]
for trusted in (parse_trusted_keys(keys), None):
    try:
        found = lookup(root, command_key(), trusted=trusted)
        print(json.dumps([found.status, found.reason]))
    except OSError as error:
        print(json.dumps(["raised", type(error).__name__]))
"""


_UNREADABLE = {  # what is made unreadable -> what the open mode does, as it always did
    "artifacts/sub/graph_1.rbln": ["hit", ""],
    "artifacts/sub": ["raised", "PermissionError"],
    "signature.json": ["hit", ""],
    "manifest.json": ["raised", "PermissionError"],
    "artifacts/\x1b[2Jnamed": ["raised", "PermissionError"],  # a folder whose name a terminal obeys
}


@pytest.mark.parametrize("what", list(_UNREADABLE))
def test_an_entry_made_unreadable_is_untrusted_never_an_exit(
    tmp_path: Path, keys: dict[str, SecretKey], what: str
) -> None:
    """A writer of the volume takes the read away (chmod 000): every trusting pod, the builder
    among them, exited 74 on each start for it, and nothing replaced it. Now it is untrusted: the
    signing key's holder sets it aside and publishes its own, the others wait. The open mode is
    as it was (a hit on an unreadable file, an I/O error on an unreadable folder or manifest)."""
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, keys["builder-1"], extra=("\x1b[2Jnamed/graph_3.rbln",))
    writable(entry)
    (entry / what).chmod(0)
    result = subprocess.run(
        [*_UNPRIVILEGED, sys.executable, "-c", _LOOKUP, str(root.path), str(keys["builder-1"].public)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    trusting, open_mode = (json.loads(line) for line in result.stdout.splitlines())
    assert trusting[0] == "untrusted", trusting
    assert "not readable by this pod" in trusting[1]
    assert trusting[1].isprintable(), "a name no key vouched for is shown only if it is plain"
    assert open_mode == _UNREADABLE[what]


@pytest.mark.quick
def test_the_content_check_returns_the_first_problem_in_order(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, keys["builder-1"])
    records = [r for r in read_manifest(entry).files if r.path.startswith("artifacts/")]
    files = [Expected(r.path, r.size, r.blake3 or "") for r in records]
    assert first_problem(root.path, entry, files, workers=3) is None
    writable(entry)
    for record in records[1:]:
        change_keeping_size_and_mtime(entry / record.path)
    problem = first_problem(root.path, entry, files, workers=3)
    assert problem is not None
    assert problem.path == records[1].path
    (entry / records[2].path).unlink()
    assert first_problem(root.path, entry, files[2:], workers=1) is not None


@pytest.mark.quick
def test_the_first_problem_is_the_first_in_order_when_a_later_file_is_found_wrong_sooner(
    tmp_path: Path,
) -> None:
    """Two workers: one hashes a large file changed at its end, the other finds a small file after
    it wrong at once and stops both. The answer is the large file, the first in order (it was
    the later one: a worker's luck named the file, and pods named different files for one damage)."""
    from blake3 import blake3

    root = _volume(tmp_path)
    entry = root.path / "entries" / "x"
    entry.mkdir()
    sizes = {"a.rbln": 4096, "big.rbln": 48 << 20, "c.rbln": 4096, "d.rbln": 4096}
    files = []
    for name, size in sizes.items():
        data = bytearray(os.urandom(size))
        files.append(Expected(name, size, blake3(bytes(data)).hexdigest()))
        if name != "a.rbln":
            data[-1] ^= 0xFF  # changed at the very end: found only when the whole file is read
        (entry / name).write_bytes(bytes(data))
    problem = first_problem(root.path, entry, files, workers=2)
    assert problem is not None
    assert problem.path == "big.rbln", problem


@pytest.mark.quick
def test_a_stop_ends_the_content_check_and_is_never_taken_for_a_verdict(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    """SIGTERM while a trusting pod reads the entry: InterruptedError (the run stops, no server
    starts), neither a trusted nor an untrusted verdict."""
    root, key = _volume(tmp_path), command_key()
    entry = _publish(root, key, keys["builder-1"])
    stop = threading.Event()
    stop.set()
    records = [r for r in read_manifest(entry).files if r.path.startswith("artifacts/")]
    with pytest.raises(InterruptedError):
        first_problem(
            root.path, entry, [Expected(r.path, r.size, r.blake3 or "") for r in records], stop=stop
        )
    with pytest.raises(InterruptedError):
        lookup(root, key, trusted=_trusting(keys["builder-1"]), stop=stop)
    assert lookup(root, key, trusted=_trusting(keys["builder-1"]), stop=threading.Event()).status == "hit"


@pytest.mark.quick
def test_inspection_shows_signer_and_trust(tmp_path: Path, keys: dict[str, SecretKey]) -> None:
    root = _volume(tmp_path)
    signed, other = command_key(), command_key("decode")
    _publish(root, signed, keys["builder-1"])
    forged = _publish(root, other, keys["builder-1"])
    change_keeping_size_and_mtime(artifact_files(forged)[0])
    trusted = _trusting(keys["builder-1"])

    listing = {e.key: e for e in list_cache(root, compat=None, trusted=trusted).entries}
    assert listing[signed.digest].signer == "builder-1"
    assert listing[signed.digest].trust == "trusted"
    assert list_cache(root, compat=None).entries[0].trust is None, "not checked without keys"
    others = {
        e.key: e.trust for e in list_cache(root, compat=None, trusted=_trusting(keys["other-1"])).entries
    }
    assert others == {signed.digest: "untrusted: key builder-1", other.digest: "untrusted: key builder-1"}

    detail = show(root, signed.short, compat=None, trusted=trusted).to_json()
    assert detail["signer"] == "builder-1"
    assert detail["trust"] == "trusted"
    assert detail["signature"]["built_by"]["pod"] == "builder"

    report = verify(root, [], fix=False, trusted=trusted)
    statuses = {i.key: (i.status, i.signer, i.trust) for i in report.items}
    assert statuses[signed.digest] == ("ok", "builder-1", "trusted")
    assert statuses[other.digest][0] == "damaged", "the full check hashes the changed file"
    assert report.damage_error() is not None

    assert explain(root, signed, trusted=trusted).to_json()["trust"] == "trusted"
    why = explain(root, other, trusted=trusted)
    assert why.result == "untrusted"
    assert "changed after signing" in why.untrusted
    assert any("never loads it" in line for line in why.advice)


@pytest.mark.quick
def test_the_signer_ls_shows_is_the_signatures_with_trusted_keys_and_a_key_name_without(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    """A forger keeps summary.json's "signer": with trusted keys `ls` shows the key the signature
    names (none: unsigned), never the claim; without, a claim that is not a key name is not shown."""
    root = _volume(tmp_path)
    forged, planted = command_key(), command_key("decode")
    forge_unsigned(_publish(root, forged, keys["builder-1"]))  # summary.json still says builder-1
    entry = _publish(root, planted, None)
    writable(entry)
    summary = json.loads((entry / "summary.json").read_text())
    (entry / "summary.json").write_text(json.dumps({**summary, "signer": "\x1b[31mbuilder-1\nok"}))
    rebuild_manifest(entry)
    trusting = {e.key: e for e in list_cache(root, compat=None, trusted=_trusting(keys["builder-1"])).entries}
    assert (trusting[forged.digest].signer, trusting[forged.digest].trust) == (None, "untrusted: unsigned")
    assert trusting[planted.digest].signer is None
    claims = {e.key: e.signer for e in list_cache(root, compat=None).entries}
    assert claims == {forged.digest: "builder-1", planted.digest: None}, "a claim, shown only as a key name"


@pytest.mark.quick
def test_verify_fix_moves_an_untrusted_entry_aside_with_its_reason(
    tmp_path: Path, keys: dict[str, SecretKey]
) -> None:
    root, key = _volume(tmp_path), command_key()
    _publish(root, key, keys["other-1"])
    report = verify(root, [], fix=True, trusted=_trusting(keys["builder-1"]))
    (item,) = report.items
    assert item.status == "untrusted"
    assert item.moved_to
    reason = json.loads(Path(item.moved_to + ".reason.json").read_text())["reason"]
    assert reason == "untrusted: key other-1"
    line = report.damage_error().one_line().lower()  # type: ignore[union-attr]
    assert "untrusted entries" in line
    # Not storage damage: a pod without the signing key does not compile it again, the builder does.
    assert "the next pod start compiles" not in line
    assert "a publisher with the signing key" in line
    assert "without a trusted key" in line
    assert entry_dirs(root.path) == []
    assert list((root.quarantine).iterdir()), "nothing is deleted for being untrusted"
    # prune --damaged offers it as what it is: set aside untrusted, not damaged storage.
    plan = plan_prune(root, scan(root), PruneRequest(damaged=True), identity=PodIdentity.current({}))
    assert [item.reason for item in plan.items] == [
        "moved aside as untrusted (not signed by a trusted key as it is)"
    ]


# --- pods --------------------------------------------------------------------------------------


def _options(record: Path) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record)]


def _env(*, trusted: list[SecretKey] | None = None, signing: Path | None = None) -> dict[str, str]:
    env: dict[str, str] = {}
    if trusted:
        env["CACHEMGR_TRUSTED_KEYS"] = " ".join(str(k.public) for k in trusted)
    if signing is not None:
        env["CACHEMGR_SIGNING_KEY_FILE"] = str(signing)
    return env


def _loads(pods: Cluster, pod: Pod) -> list[dict[str, Any]]:
    return [e for e in pods.record if e["event"] == "load" and str(pod.state_dir) in e["path"]]


def _events(pod: Pod, name: str) -> list[dict[str, Any]]:
    return [e for e in pod.log_events() if e.get("event") == name]


@pytest.fixture
def signing(tmp_path: Path) -> dict[str, tuple[SecretKey, Path]]:
    return {name: new_key(tmp_path / "keys", name) for name in ("builder-1", "builder-2", "other-1")}


def _build(pods: Cluster, root: Path, record: Path, key_file: Path, *, name: str = "builder") -> None:
    """The builder: a warm Job with the signing key fills the cache."""
    job = pods.start(
        name,
        server_argv(free_port()),
        cache_root=root,
        command="warm",
        options=_options(record),
        env=_env(signing=key_file),
    )
    assert job.wait_exit() == 0, job.tail()


def test_a_trusting_pod_serves_a_signed_entry_and_never_a_forged_one(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, key_file)
    trusting = _env(trusted=[secret])
    pod = pods.start("t0", server_argv(free_port()), cache_root=root, options=_options(record), env=trusting)
    pod.wait_phase("serving")
    assert _events(pod, "launching")[0]["signer"] == "builder-1"
    (read,) = _events(pod, "prefetch_done")
    assert read["stopped"] == "content_checked", "the check before the launch was the read-ahead: one pass"
    assert _loads(pods, pod)
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0

    (entry,) = entry_dirs(root)
    forge_unsigned(entry)  # the right name, a self-consistent manifest, written without the key
    fail = [*_options(record), "--on-miss", "fail"]
    pod = pods.start("t1", server_argv(free_port()), cache_root=root, options=fail, env=trusting)
    assert pod.wait_exit() == 69
    (warning,) = _events(pod, "entry_untrusted")
    assert warning["reason"] == "untrusted: unsigned"
    assert "does not compile" in (pod.state_dir / "termination-log").read_text()
    assert _loads(pods, pod) == [], "the server never started"
    assert entry_dirs(root) == [entry], "a pod without the signing key leaves it where it is"


def test_a_file_changed_with_its_size_and_mtime_put_back_is_served_only_in_the_open_mode(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, key_file)
    (entry,) = entry_dirs(root)
    writable(entry)
    # rbln_config.json, which the stand-in (as optimum-rbln) reads without a hash of its own.
    config = next((entry / "artifacts").rglob("rbln_config.json"))
    change_keeping_size_and_mtime(config, old=b"Test-LLM", new=b"Test-LLX")
    fail = [*_options(record), "--on-miss", "fail"]
    pod = pods.start("t", server_argv(free_port()), cache_root=root, options=fail, env=_env(trusted=[secret]))
    assert pod.wait_exit() == 69
    (warning,) = _events(pod, "entry_untrusted")
    assert "changed after signing" in warning["reason"]
    assert warning["signer"] == "builder-1"
    assert _loads(pods, pod) == []
    # The open mode's fast check (size, mtime) cannot see it: the risk the trusting mode removes.
    pod = pods.start("open", server_argv(free_port()), cache_root=root, options=fail)
    pod.wait_phase("serving")
    assert _loads(pods, pod)


def test_a_signing_pod_sets_an_untrusted_entry_aside_and_publishes_its_own(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, signing["other-1"][1], name="stranger")
    secret, key_file = signing["builder-1"]
    pod = pods.start(
        "b", server_argv(free_port()), cache_root=root, options=_options(record),
        env=_env(trusted=[secret], signing=key_file),
    )  # fmt: skip
    pod.wait_phase("serving")
    (warning,) = _events(pod, "entry_untrusted")
    assert warning["reason"] == "untrusted: key other-1"
    assert warning["moved_to"]
    assert compiles(record) == 2, "the stranger's compile, then the builder's own"
    (entry,) = entry_dirs(root)
    assert json.loads((entry / "summary.json").read_text())["signer"] == "builder-1"
    listed = run_cli("ls", "-o", "json", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    rows = json.loads(listed.stdout)["items"]
    (aside,) = [r for r in rows if r["kind"] == "quarantine"]
    assert aside["problem"] == "untrusted: key other-1", "ls says why it was set aside"
    text = run_cli("ls", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}).stdout
    assert "untrusted: key other-1" in text


def test_keys_rotate_old_and_new_serve_both_new_only_serves_only_the_new(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    old, old_file = signing["builder-1"]
    new, new_file = signing["builder-2"]
    record = pods.work / "compiler.jsonl"
    old_options = _options(record)
    new_options = ["--strategy", "command", "--compile-cmd", compile_cmd(record, extra="--files 5")]
    _build(pods, root, record, old_file, name="old-builder")
    job = pods.start(
        "new-builder",
        server_argv(free_port()),
        cache_root=root,
        command="warm",
        options=new_options,
        env=_env(signing=new_file),
    )
    assert job.wait_exit() == 0
    both = _env(trusted=[old, new])
    for name, options in (("both-old", old_options), ("both-new", new_options)):
        pod = pods.start(
            name, server_argv(free_port()), cache_root=root, options=[*options, "--on-miss", "fail"], env=both
        )
        pod.wait_phase("serving")
    only_new = _env(trusted=[new])
    pod = pods.start(
        "new-new",
        server_argv(free_port()),
        cache_root=root,
        options=[*new_options, "--on-miss", "fail"],
        env=only_new,
    )
    pod.wait_phase("serving")
    pod = pods.start(
        "new-old",
        server_argv(free_port()),
        cache_root=root,
        options=[*old_options, "--on-miss", "fail"],
        env=only_new,
    )
    assert pod.wait_exit() == 69
    assert _events(pod, "entry_untrusted")[0]["reason"] == "untrusted: key builder-1"


def test_the_canary_pickle_runs_in_the_open_mode_and_never_in_the_trusting_one(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, key_file)
    (entry,) = entry_dirs(root)
    canary = pods.work / "canary"
    plant_canary(entry, canary)
    fail = [*_options(record), "--on-miss", "fail"]
    pod = pods.start(
        "trusting", server_argv(free_port()), cache_root=root, options=fail, env=_env(trusted=[secret])
    )
    assert pod.wait_exit() == 69
    assert not canary.exists(), "a trusting pod never starts a server on it"
    pod = pods.start("open", server_argv(free_port()), cache_root=root, options=fail)
    pod.wait_phase("serving")
    assert canary.exists(), "the open mode: whoever wrote the entry ran code in the pod"


def test_a_pod_without_the_signing_key_waits_for_the_builder_then_serves(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "t", server_argv(free_port()), cache_root=root, options=_options(record), env=_env(trusted=[secret])
    )
    pod.wait_phase("waiting")
    (said,) = _events(pod, "waiting_for_publisher")
    assert "holds none" in said["reason"]
    assert not record.exists(), "it never compiles"
    _build(pods, root, record, key_file)
    pod.wait_phase("serving")
    assert compiles(record) == 1


def test_sigterm_while_waiting_for_a_publisher_leaves_nothing_behind(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, _ = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "t", server_argv(free_port()), cache_root=root, options=_options(record), env=_env(trusted=[secret])
    )
    pod.wait_phase("waiting")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 128 + signal.SIGTERM
    assert "stopped by signal 15" in (pod.state_dir / "termination-log").read_text()
    assert_clean_after_failure(root)
    assert not record.exists()


def test_a_trusting_pod_on_a_read_only_mount_serves_a_signed_hit_and_writes_nothing(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]], readonly_bind: Any
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    mounted = readonly_bind(root)
    trusting = _env(trusted=[secret])
    # A miss first: the read-only pod waits for the builder (it cannot compile), then serves.
    waiter = pods.start(
        "ro-0", server_argv(free_port()), cache_root=mounted, options=_options(record), env=trusting
    )
    waiter.wait_phase("waiting")
    assert "read-only" in _events(waiter, "waiting_for_publisher")[0]["reason"]
    _build(pods, root, record, key_file)
    waiter.wait_phase("serving")
    before = tree_state(root)
    pod = pods.start(
        "ro-1", server_argv(free_port()), cache_root=mounted, options=_options(record), env=trusting
    )
    pod.wait_phase("serving")
    (event,) = _events(pod, "read_only_volume")
    assert event["note"] == "a hit writes nothing there", event
    assert _loads(pods, pod)
    for each in (pod, waiter):
        each.signal(signal.SIGTERM)
        assert each.wait_exit() == 0
    assert tree_state(root) == before, "the read-only pod changed nothing on the volume"


def test_an_open_pod_on_a_read_only_mount_is_told_to_run_a_warm_job_not_a_signing_builder(
    pods: Cluster, root: Path, readonly_bind: Any
) -> None:
    record = pods.work / "compiler.jsonl"
    waiter = pods.start(
        "ro-open", server_argv(free_port()), cache_root=readonly_bind(root), options=_options(record)
    )
    waiter.wait_phase("waiting")
    (said,) = _events(waiter, "waiting_for_publisher")
    assert "read-only" in said["reason"], said
    assert "signing key" not in said["note"], said
    assert "warm Job" in said["note"], said
    waiter.signal(signal.SIGTERM)
    assert waiter.wait_exit() == 143


def test_a_read_only_pod_with_usage_mounted_writable_records_its_use_and_prune_keeps_the_entry(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]], readonly_bind: Any
) -> None:
    """The chart's trust.recordUse: the claim's usage/ mounted read-write over the read-only
    volume. The serving pod writes its use record there and nothing else; a prune by age run
    from the builder's side sees it (without it, the entry went: the pod recorded no use)."""
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, key_file)
    (entry,) = entry_dirs(root)
    mounted = readonly_bind(root)
    outside_usage = {k: v for k, v in tree_state(root).items() if not k.startswith("usage")}
    with writable_bind(root / "usage", mounted / "usage"):
        pod = pods.start(
            "ro-1", server_argv(free_port()), cache_root=mounted, options=_options(record),
            env=_env(trusted=[secret]),
        )  # fmt: skip
        pod.wait_phase("serving")
        (event,) = _events(pod, "read_only_volume")
        assert "use record" in event["note"], event
        assert list((root / "usage").glob("*/ro-1.*.json")), "the use record, on the volume"
        # 0s: every entry is chosen by age, so the plan must keep this one for its user. With 1s
        # the choice hung on the pod's last beat (every 2 s) being a second old: half the time
        # nothing was chosen and the test failed on "nothing to prune".
        pruned = run_cli("prune", "--unused-for", "0s", "--yes", "--cache-root", str(root), env=pods.base_env)
        assert pruned.returncode == 0, pruned.stderr
        assert entry.is_dir(), f"the entry in use was removed:\n{pruned.stdout}"
        assert "in use by ro-1" in " ".join(pruned.stdout.split()), pruned.stdout
        pod.signal(signal.SIGTERM)
        assert pod.wait_exit() == 0
    assert {k: v for k, v in tree_state(root).items() if not k.startswith("usage")} == outside_usage


_CRYPTO = ("cryptography", "blake3", "_cffi_backend", "cachemgr.volume.trust", "cachemgr.volume.contentcheck")


def _modules_of_a_hit(pods: Cluster, root: Path, options: list[str], env: dict[str, str]) -> set[str]:
    code = (
        "import sys\n"
        "from cachemgr.cli.main import main\n"
        "code = main(sys.argv[1:])\n"
        "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n"
        "sys.exit(code)\n"
    )
    env = {
        **pods.base_env,
        **env,
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_STATE_DIR": str(pods.work / "st"),
    }
    result = subprocess.run(
        [sys.executable, "-c", code, "warm", *options, "--", *server_argv(free_port())],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return set(result.stderr.split()[-2000:])


def test_a_hit_in_the_open_mode_imports_no_cryptography(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, key_file)
    loaded = _modules_of_a_hit(pods, root, _options(record), {})
    heavy = sorted(m for m in loaded if m.split(".")[0] in _CRYPTO or m in _CRYPTO)
    assert heavy == [], f"an open-mode hit must not import the trust code, but loaded {heavy}"
    trusting = _modules_of_a_hit(pods, root, _options(record), _env(trusted=[secret]))
    assert {"cryptography", "blake3"} <= {m.split(".")[0] for m in trusting}, "the check ran"


def test_explain_and_verify_say_why_an_entry_is_untrusted(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    secret, key_file = signing["builder-1"]
    record = pods.work / "compiler.jsonl"
    _build(pods, root, record, key_file)
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), **_env(trusted=[secret])}
    assert run_cli("verify", env=env).returncode == 0
    (entry,) = entry_dirs(root)
    forge_keeping_signature(entry)
    verified = run_cli("verify", "-o", "json", env=env)
    assert verified.returncode == 74
    (item,) = json.loads(verified.stdout)["items"]
    assert item["status"] == "untrusted"
    assert item["signer"] == "builder-1"
    explained = run_cli("explain", *_options(record), "--", *server_argv(8000), env=env)
    assert explained.returncode == 1  # not a hit: no pod would load it (docs/reference.md)
    assert "untrusted: the manifest's files are not the signed ones" in explained.stdout


def test_the_vllm_strategy_signs_its_snapshot_and_a_trusting_pod_serves_it(
    pods: Cluster, root: Path, signing: dict[str, tuple[SecretKey, Path]]
) -> None:
    """The server compiles in its staging and serves on; the hard-linked copy that is published is
    signed from that private staging, before its rename (the other strategy than the rest here)."""
    secret, key_file = signing["builder-1"]
    builder = pods.start(
        "vllm-builder", vllm_argv(free_port()), cache_root=root, env=_env(trusted=[secret], signing=key_file)
    )
    builder.wait_phase("serving")
    (entry,) = entry_dirs(root)
    assert json.loads((entry / "summary.json").read_text())["signer"] == "builder-1"
    pod = pods.start(
        "vllm-t",
        vllm_argv(free_port()),
        cache_root=root,
        options=["--on-miss", "fail"],
        env=_env(trusted=[secret]),
    )
    pod.wait_phase("serving")
    assert _events(pod, "launching")[0]["signer"] == "builder-1"
    assert pods.compiles() == 1
