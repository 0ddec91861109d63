"""A rollout: two images on one volume, an operator in either (issue 32).

Two real "images" differ the way an upgrade makes them differ: an SDK upgrade (the RBLN Compiler
and vllm-rbln: 0.12 -> 0.13) or a server upgrade alone (vllm-rbln 0.12.0 -> 0.12.1, the same
compiler), each declared as the modelserver image declares it (CACHEMGR_COMPILER_VERSION,
CACHEMGR_VLLM_RBLN_VERSION, ...), with the stand-in server. The old image's pods serve; the new
image's warm Jobs publish ahead of the rollout; the new pods start on hits; then an operator types
every inspection and prune command in a pod of the old image and of the new one, as
``kubectl exec deploy/...`` lands in either. No entry of the newer generation is lost, no entry
in use is lost, and every message says which generation holds what.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit.podlib import DEADLINE, Cluster, Pod, cluster, free_port, npu_node, skewed_env
from cachemgr_testkit.scenarios import MODEL, entry_dirs

# Each image as it declares itself to cachemgr; the rest of DECLARED_VERSIONS (vLLM, transformers)
# stays the stand-in's.
IMAGES = {
    "sdk": (
        {"CACHEMGR_COMPILER_VERSION": "0.12.3", "CACHEMGR_VLLM_RBLN_VERSION": "0.12.0", "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.12.0"},
        {"CACHEMGR_COMPILER_VERSION": "0.13.0", "CACHEMGR_VLLM_RBLN_VERSION": "0.13.0", "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.13.0"},
    ),
    "server": (
        {"CACHEMGR_COMPILER_VERSION": "0.12.3", "CACHEMGR_VLLM_RBLN_VERSION": "0.12.0"},
        {"CACHEMGR_COMPILER_VERSION": "0.12.3", "CACHEMGR_VLLM_RBLN_VERSION": "0.12.1"},
    ),
}  # fmt: skip
# What each upgrade makes of the old image's entries in the new image's eyes, and how it says it.
OLDER = {"sdk": "incompatible", "server": "superseded"}
NEWER_WORDS = {
    "sdk": "compiler 0.13, this image has 0.12",
    "server": "vllm-rbln 0.12.1, this image has 0.12.0",
}
OLDER_WORDS = {
    "sdk": "compiler 0.12, this image has 0.13",
    "server": "vllm-rbln 0.12.0, this image has 0.12.1",
}
# Each entry is named by its compiler and vllm-rbln (explain's nearest entries, prune's notes);
# tables of generations add every part that tells them apart (here optimum-rbln too).
SHORT = {"sdk": ("compiler 0.12, vllm-rbln 0.12.0", "compiler 0.13, vllm-rbln 0.13.0")}
LABELS = {
    "sdk": (
        "compiler 0.12, vllm-rbln 0.12.0, optimum-rbln 0.12.0",
        "compiler 0.13, vllm-rbln 0.13.0, optimum-rbln 0.13.0",
    ),
    "server": ("compiler 0.12, vllm-rbln 0.12.0", "compiler 0.12, vllm-rbln 0.12.1"),
}


def argv(tp: int) -> list[str]:
    return ["vllm", "serve", MODEL, "--tensor-parallel-size", str(tp), "--port", str(free_port())]


@dataclass
class Rollout:
    """The volume, the pods of both images, and an operator's shell in a pod of either."""

    pods: Cluster
    root: Path
    kind: str

    def image(self, which: str) -> dict[str, str]:
        old, new = IMAGES[self.kind]
        # A pod on an NPU node: the device answers the NPU type (cachemgr.key.npu).
        return {**(old if which == "old" else new), **npu_node(self.pods.work)}

    def warm(self, which: str, tp: int, name: str) -> str:
        """A warm Job of that image (CPU node, compile only): its report on the volume's space,
        the line before its last (what it compiled)."""
        env = {**self.image(which), "VLLM_RBLN_COMPILE_ONLY": "1"}
        job = self.pods.start(name, argv(tp), cache_root=self.root, command="warm", env=env)
        assert job.wait_exit() == 0, job.tail()
        return job.log.read_text().rstrip().splitlines()[-2]

    def serve(self, which: str, tp: int, name: str) -> Pod:
        pod = self.pods.start(name, argv(tp), cache_root=self.root, env=self.image(which))
        pod.wait_phase("serving")
        return pod

    def shell(self, which: str) -> dict[str, str]:
        """``kubectl exec`` into a pod of that image: its environment, a console log."""
        env = {**self.pods.base_env, **self.image(which), "CACHEMGR_CACHE_ROOT": str(self.root)}
        return {**env, "CACHEMGR_LOG_FORMAT": "console", "COLUMNS": "200"}

    def cli(self, which: str, *args: str, code: int = 0) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "cachemgr", *args],
            env=self.shell(which),
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
            stdin=subprocess.DEVNULL,
        )
        assert done.returncode == code, (
            f"cachemgr {' '.join(args)} in the {which} image:\n{done.stdout}{done.stderr}"
        )
        assert "Traceback" not in done.stderr, done.stderr
        return done.stdout

    def json(self, which: str, *args: str, code: int = 0) -> Any:
        cut = args.index("--") if "--" in args else len(args)
        return json.loads(self.cli(which, *args[:cut], "-o", "json", *args[cut:], code=code))

    def entries(self) -> dict[tuple[str, int], str]:
        """Entry names by (image, tensor-parallel size), from their key.json."""
        old_compiler, old_server = (
            IMAGES[self.kind][0][k] for k in ("CACHEMGR_COMPILER_VERSION", "CACHEMGR_VLLM_RBLN_VERSION")
        )
        found = {}
        for entry in entry_dirs(self.root):
            inputs = json.loads((entry / "key.json").read_text())["inputs"]
            old = inputs["versions"]["vllm_rbln"] == old_server and old_compiler.startswith(
                inputs["compiler"]
            )
            found[("old" if old else "new", inputs["serving"]["tensor_parallel_size"])] = entry.name
        return found


@pytest.fixture
def rollout(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Rollout]:
    root = tmp_path / "volume"
    root.mkdir()
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        yield Rollout(pods, root, request.param)


def stop(pod: Pod) -> None:
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0, pod.tail()


def parallel(*calls: Callable[[], Any]) -> list[Any]:
    """Read-only commands at once (they never write the volume but ls's and du's hints)."""
    with ThreadPoolExecutor(max_workers=4) as pool:
        return [f.result() for f in [pool.submit(call) for call in calls]]


@pytest.mark.timeout(300)  # seven pods and some sixty commands, one after another
@pytest.mark.parametrize("rollout", ["sdk", "server"], indirect=True)
def test_a_rollout_loses_no_entry_whichever_image_the_operator_types_in(rollout: Rollout) -> None:
    r, kind, older = rollout, rollout.kind, OLDER[rollout.kind]
    old_label, new_label = LABELS[kind]
    # The old image: an earlier warm Job compiled TP 8, two pods serve TP 4.
    r.warm("old", 8, "old-warm-tp8")
    old_pods = [r.serve("old", 4, name) for name in ("old-1", "old-2")]
    # The new image's warm Jobs run before anything rolls: what its pods serve, and a canary.
    for tp in (4, 8):
        line = r.warm("new", tp, f"new-warm-tp{tp}")
        assert line.startswith("warm: both generations fit: this generation (" + new_label), line
        assert f"the older ({old_label}) " in line
        assert "in use by old-1, old-2" in line
    before = r.pods.compiles()
    new_1 = r.serve("new", 4, "new-1")
    assert r.pods.compiles() == before, "the rollout's first new pod starts on the warm Job's entry"
    names = r.entries()
    newer = {names[("new", 4)], names[("new", 8)]}
    in_use = {names[("old", 4)], names[("new", 4)]}

    # An operator in a pod of the OLD image: the newer generation is a newer image's, never dead.
    inspect_old_image(r, names)
    prune_everything(r, "old", names)
    assert newer | in_use <= {p.name for p in entry_dirs(r.root)}, (
        "the old image lost a newer or a used entry"
    )

    # In a pod of the NEW image: the older generation's entry nobody uses goes; the one in use stays.
    inspect_new_image(r, names)
    plan = r.json("new", "prune", f"--{older}", "--dry-run")["plan"]
    assert [i["name"] for i in plan["items"]] == [names[("old", 8)]]
    assert plan["items"][0]["reason"] == f"{older}: {OLDER_WORDS[kind]}"
    assert plan["items"][0]["vs_image"] == "older"
    short_old = SHORT.get(kind, LABELS[kind])[0]
    assert plan["items"][0]["generation"] == short_old
    (kept,) = plan["kept"]
    assert kept == {"name": names[("old", 4)], "reason": f"in use by old-1, old-2 ({older}: {short_old})"}
    prune_everything(r, "new", names)
    left = {p.name for p in entry_dirs(r.root)}
    assert newer | in_use <= left
    assert names[("old", 8)] not in left

    # The rollout completes: the old pods go, a new one starts on a hit.
    for pod in old_pods:
        stop(pod)
    r.serve("new", 4, "new-2")
    assert r.pods.compiles() == before
    text = r.cli("new", "prune", f"--{older}", "--yes")
    assert f"{older}: {OLDER_WORDS[kind]}" in text
    assert "removed 1 item of 1" in text
    assert {p.name for p in entry_dirs(r.root)} == newer
    # A shell of the old image after the rollout (a rollback's toolbox) still removes nothing newer.
    text = r.cli("old", "ls")
    assert f"newer: {new_label} (2 entries" in text
    assert "nothing to prune" in r.cli("old", "prune", "--incompatible", "--superseded", "--yes")
    (note,) = r.json("old", "prune", "--incompatible", "--superseded", "--dry-run")["plan"]["notes"]
    assert note.startswith("2 entries of a newer image (2.0 MiB) left: this image's --incompatible and"), note
    assert {p.name for p in entry_dirs(r.root)} == newer
    assert new_1.proc.poll() is None, "nothing stopped"
    assert r.pods.compiles() == before, "nothing compiled again"


def inspect_old_image(r: Rollout, names: dict[tuple[str, int], str]) -> None:
    """Every inspection command in an old pod says which generation holds what."""
    kind = r.kind
    old_label, new_label = LABELS[kind]
    new4 = names[("new", 4)]
    rows, table, show, show_old, hit, miss, du, du_json, verify, locks, stats = parallel(
        lambda: r.json("old", "ls")["items"],
        lambda: r.cli("old", "ls", "-o", "wide"),
        lambda: r.cli("old", "show", new4),
        lambda: r.json("old", "show", names[("old", 4)]),
        lambda: r.cli("old", "explain", "--", *argv(4)),
        lambda: r.cli("old", "explain", "--", *argv(16), code=1),
        lambda: r.cli("old", "du"),
        lambda: r.json("old", "du"),
        lambda: r.json("old", "verify"),
        lambda: r.json("old", "locks")["items"],
        lambda: r.json("old", "stats"),
    )
    entries = {row["entry"]: row for row in rows if row["kind"] == "entry"}
    for tp in (4, 8):
        row = entries[names[("new", tp)]]
        assert (row["status"], row["problem"], row["vs_image"]) == ("newer", NEWER_WORDS[kind], "newer")
        assert entries[names[("old", tp)]]["status"] == "published"
        assert entries[names[("old", tp)]]["vs_image"] == "same"
    assert f"this image: {old_label} (2 entries, 2.0 MiB, 1.0 MiB in use by 2 pods)" in table
    assert (
        f"newer: {new_label} (2 entries, 2.0 MiB, 1.0 MiB in use by 1 pod): a newer image's, never removed"
        in table
    )
    assert f"newer      {new_label}" in table, "-o wide names each entry's generation"
    assert f"status       newer ({NEWER_WORDS[kind]}): a newer image's entry, never removed" in show
    assert "(newer than this image's: a newer image's)" in show
    assert show_old["status"] == "ok"
    assert show_old["vs_image"] == "same"
    assert "result        HIT" in hit
    assert f"the volume holds a newer generation ({new_label}: 2 entries" in hit
    short_new = SHORT.get(kind, LABELS[kind])[1]
    assert f"newer: {short_new}" in miss.split("NEAREST ENTRIES")[1], (
        "the nearest entries name their generation"
    )
    # The newer image's release is not one cachemgr was checked against: its keys are strict, and
    # inputs such as model_impl differ by the rules alone, which explain says beside the rules line.
    rules_line = next(
        line for line in miss.splitlines() if line.strip().startswith("rules ") and "->" in line
    )
    assert rules_line.endswith("(and the inputs below may differ by the rules alone)"), rules_line
    assert f"this image  {old_label}: 2 entries, 2.0 MiB, 1.0 MiB in use by old-1, old-2\n" in du
    assert f"{new_label}: 2 entries, 2.0 MiB, 1.0 MiB in use by new-1; a newer image's: this image's" in du
    assert {g["label"]: g["vs_image"] for g in du_json["by_generation"]} == {
        old_label: "this image",
        new_label: "newer",
    }
    assert du_json["prunable"]["incompatible"]["bytes"] == du_json["prunable"]["superseded"]["bytes"] == 0
    assert {i["status"] for i in verify["items"]} == {"ok"}
    assert locks == []
    assert len(stats["items"]) == 4


def flat(text: str) -> str:
    """The words of ``text``, one space apart (a note wrapped at the terminal's width, a column)."""
    return " ".join(text.split())


def inspect_new_image(r: Rollout, names: dict[tuple[str, int], str]) -> None:
    """Every inspection command in a new pod: the older generation, and who keeps it."""
    kind, older = r.kind, OLDER[r.kind]
    old_label, new_label = LABELS[kind]
    rows, table, show, hit, du, du_json = parallel(
        lambda: r.json("new", "ls")["items"],
        lambda: r.cli("new", "ls"),
        lambda: r.cli("new", "show", names[("old", 4)]),
        lambda: r.cli("new", "explain", "--", *argv(4)),
        lambda: r.cli("new", "du"),
        lambda: r.json("new", "du"),
    )
    # The tables' notes are wrapped at the terminal's width: compare their words.
    table, show, hit, du = (flat(text) for text in (table, show, hit, du))
    entries = {row["entry"]: row for row in rows if row["kind"] == "entry"}
    for tp in (4, 8):
        row = entries[names[("old", tp)]]
        assert (row["status"], row["problem"], row["vs_image"]) == (older, OLDER_WORDS[kind], "older")
        assert entries[names[("new", tp)]]["status"] == "published"
    assert (
        f"older: {old_label} (2 entries, 2.0 MiB, {older}): 'cachemgr prune --{older}' frees 1.0 MiB of them now; "
        "1.0 MiB in use by 2 pods, kept until those pods stop"
    ) in table
    assert (
        flat(
            f"status       {older} ({OLDER_WORDS[kind]}): 'cachemgr prune --{older}' removes it (kept while a pod uses it)"
        )
        in show
    )
    assert (
        f"the volume holds an older generation ({old_label}: 2 entries, 2.0 MiB, 1.0 MiB in use by old-1, old-2): "
        f"this image never uses it; 'cachemgr prune --{older} --yes' frees 1.0 MiB of it now, the rest once no pod "
        "runs the older image"
    ) in hit
    assert (
        f"{old_label}: 2 entries, 2.0 MiB, 1.0 MiB in use by old-1, old-2; --{older} frees 1.0 MiB now, "
        "the rest once those pods stop" in du
    )
    assert du_json["prunable"][older]["bytes"] == entries[names[("old", 8)]]["size_bytes"]
    assert {g["label"]: g["vs_image"] for g in du_json["by_generation"]} == {
        new_label: "this image",
        old_label: "older",
    }


def prune_everything(r: Rollout, which: str, names: dict[tuple[str, int], str]) -> None:
    """Every selector, dry (at once: a plan writes nothing) and then for real, all at once as
    documented (``--unused-for 14d``, ``--keep-bytes 150Gi``): what the generation selectors plan,
    and that any other selector's plan names a newer image's entry as one."""
    new_label = SHORT.get(r.kind, LABELS[r.kind])[1]
    selectors = (["--incompatible"], ["--superseded"], ["--unused-for", "0s"], ["--keep-bytes", "0"],
                 ["--for-npu", "RBLN-CA25"], ["--key", names[("new", 8)]])  # fmt: skip
    plans = parallel(*(lambda s=s: r.json(which, "prune", *s, "--dry-run")["plan"] for s in selectors))
    for selector, plan in zip(selectors, plans, strict=True):
        for item in plan["items"]:
            if which == "old":
                assert item["vs_image"] in {"this image's", "newer"}
                if item["vs_image"] == "newer":
                    assert selector[0] not in {"--incompatible", "--superseded"}, plan
                    assert f"(newer: {new_label})" in item["reason"], item
        if which == "old" and selector[0] in {"--incompatible", "--superseded"}:
            assert plan["items"] == [], plan
            assert plan["kept"] == [], plan
    r.cli(which, "prune", "--unused-for", "14d", "--keep-bytes", "150Gi", "--for-npu", "RBLN-CA12",
          "--stale-staging", "--damaged", "--failures", "--incompatible", "--superseded", "--yes")  # fmt: skip


# --- space during a rollout -----------------------------------------------------------------------


@pytest.fixture
def small(
    request: pytest.FixtureRequest, tmp_path: Path, tmpfs_small: Callable[[int], Path]
) -> Iterator[Rollout]:
    """A rollout on a volume of ``request.param`` bytes (entries of the stand-in are 1.0 MiB)."""
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        yield Rollout(pods, tmpfs_small(request.param), "sdk")


def termination(pod: Pod) -> str:
    return (pod.state_dir / "termination-log").read_text()


@pytest.mark.parametrize("small", [3 << 19], indirect=True)
def test_a_full_volume_mid_rollout_says_the_older_generation_holds_it_and_what_frees_it(
    small: Rollout,
) -> None:
    r = small
    old = r.serve("old", 4, "old-1")
    # The warm Job before the rollout (a pre-upgrade hook): the new entry cannot fit beside the
    # old one its pods use. It fails, so that nothing rolls into pods that would crash-loop.
    job = r.pods.start("new-warm", argv(4), cache_root=r.root, command="warm",
                       env={**r.image("new"), "VLLM_RBLN_COMPILE_ONLY": "1", "CACHEMGR_WARM_HOOK": "pre-upgrade"})  # fmt: skip
    assert job.wait_exit() == 73, job.tail()
    pod = r.pods.start("new-1", argv(4), cache_root=r.root, env=r.image("new"))
    assert pod.wait_exit() == 73, pod.tail()
    for message in (termination(job), termination(pod)):
        assert (
            "nothing can be pruned now: the older generation (compiler 0.12, vllm-rbln 0.12.0) holds 1.0 MiB "
            in message
        )
        assert "in 1 entry, in use by old-1. " in message
        assert " ... " not in message, "the message fits its line uncut"
    message = termination(pod)
    assert "Raise storage.compileCache.size (only where the StorageClass allows volume expansion)" in message
    assert "or let every old pod go first (rollingUpdate.maxUnavailable: replicas)" in message
    assert "then run 'cachemgr prune --incompatible --yes' in a pod that mounts this volume" in message
    assert "(the chart's toolbox: toolbox.enabled=true)" in message
    # The hook (issue 40) runs before any pod rolls: no old pod can go first. The size both
    # generations need, as a number (what the volume holds now and this compile), or warm.hook off.
    message = termination(job)
    assert "maxUnavailable" not in message, message
    assert "let every old pod" not in message, message
    free = re.search(r"([0-9.]+) KiB free of 1.5 MiB; this compile needs about 1.0 MiB", message)
    size = re.search(
        r"The pre-upgrade hook runs before any pod rolls: raise storage.compileCache.size to ([0-9.]+) MiB",
        message,
    )
    assert free, message
    assert size, message
    assert abs(float(size[1]) - (1.5 - float(free[1]) / 1024 + 1.0)) < 0.05, message
    assert (
        "or more (what it holds now and this compile) where the StorageClass allows volume expansion"
        in message
    )
    assert (
        "or set warm.hook=false (the Job then runs beside the rollout; once the old pods are gone " in message
    )
    assert "'cachemgr prune --incompatible --yes' frees theirs)." in message
    # The old pods go: the next start says what frees the space now, and that command frees it.
    stop(old)
    pod = r.pods.start("new-2", argv(4), cache_root=r.root, env=r.image("new"))
    assert pod.wait_exit() == 73, pod.tail()
    message = termination(pod)
    assert (
        "prune can free 1.0 MiB of entries no pod uses now: 1.0 MiB incompatible (an older generation: "
        in message
    )
    assert "Run 'cachemgr prune --incompatible --yes' in a pod that mounts this volume" in message
    assert "removed 1 item of 1" in r.cli("new", "prune", "--incompatible", "--yes")  # the toolbox's shell
    r.serve("new", 4, "new-3")


@pytest.mark.parametrize("small", [3 << 19], indirect=True)
def test_a_compile_that_fills_the_volume_mid_rollout_ends_on_its_whole_remedy(small: Rollout) -> None:
    """Issue 40: the exit-73 line of a compile that filled the volume while an older generation's
    pods serve was cut in the middle of its remedy ("or let every old  ... Unavailable: replicas)"),
    in the termination message kubectl describe shows. The what gives way, never what to do."""
    r = small
    r.serve("old", 4, "old-1")
    env = {**r.image("new"), "STANDIN_ARTIFACT_BYTES": str(2 << 20)}  # more than is left
    pod = r.pods.start("new-1", argv(4), cache_root=r.root, env=env, options=["--space-check", "warn"])
    assert pod.wait_exit() == 73, pod.tail()
    message = termination(pod)
    assert "were free when the compile started" in message, message
    _what, remedy = message.split(". Give it more than ", 1)
    assert remedy.endswith(
        "of free space; raise storage.compileCache.size (only where the StorageClass allows volume expansion); "
        "or let every old pod go first (rollingUpdate.maxUnavailable: replicas), then run "
        "'cachemgr prune --incompatible --yes' in a pod that mounts this volume (the chart's toolbox: "
        "toolbox.enabled=true)."
    ), message
    assert " ... " not in remedy, message


# An image before the old one: its entry is incompatible in the old image's eyes.
OLDEST = {"CACHEMGR_COMPILER_VERSION": "0.11.2", "CACHEMGR_VLLM_RBLN_VERSION": "0.11.0",
          "CACHEMGR_OPTIMUM_RBLN_VERSION": "0.11.0"}  # fmt: skip


@pytest.mark.parametrize("small", [4 << 20], indirect=True)
def test_a_full_volumes_advice_says_which_unused_bytes_are_a_newer_images_and_prune_frees_them(
    small: Rollout,
) -> None:
    """An old pod fills a volume holding three generations' entries, none used for 15 days: the
    one before it (incompatible), its own, and a newer image's (a warm Job ran ahead of a rollout
    that stalled). The advice counted the newer entry among "unused" without a word, as if this
    image's own: the operator pruned the newer image's compile unawares. It says so now, and its
    figure is what the command it names frees, to the byte."""
    r = small
    job = r.pods.start("oldest-warm", argv(4), cache_root=r.root, command="warm",
                       env={**OLDEST, **npu_node(r.pods.work), "VLLM_RBLN_COMPILE_ONLY": "1"})  # fmt: skip
    assert job.wait_exit() == 0, job.tail()
    r.warm("old", 4, "old-warm")
    r.warm("new", 4, "new-warm")
    later = skewed_env(15 * 86400)
    pod = r.pods.start("old-1", argv(8), cache_root=r.root, env={**r.image("old"), **later})
    assert pod.wait_exit() == 73, pod.tail()
    message = termination(pod)
    _, new_short = SHORT["sdk"]
    sizes = {e.name: json.loads((e / "summary.json").read_text())["size_bytes"] for e in entry_dirs(r.root)}
    assert len(sizes) == 3
    assert (
        "prune can free 3.0 MiB of entries no pod uses now: 1.0 MiB incompatible (an older generation: "
        in message
    )
    assert f"2.0 MiB unused for 14d (1.0 MiB of it a newer image's: {new_short})" in message, message
    assert (
        "Run 'cachemgr prune --incompatible --unused-for 14d --yes' in a pod that mounts this volume"
        in message
    )
    assert " ... " not in message, "the message fits its line uncut"
    (failed,) = (r.root / "failures").rglob("*.json")
    report = json.loads(failed.read_text())["report"]
    # What the named command frees, typed in a pod of the same image, the same 15 days on.
    shell = {**r.shell("old"), **later, "PYTHONPATH": later["PYTHONPATH"]}
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "prune", "--incompatible", "--unused-for", "14d", "--dry-run",
         "-o", "json"], env=shell, capture_output=True, text=True, timeout=DEADLINE, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)["plan"]
    planned = [i for i in plan["items"] if i.get("kind") == "entry"]
    assert sum(i["bytes"] for i in planned) == sum(sizes.values())
    assert report["prunable_incompatible_bytes"] + report["prunable_unused_bytes"] == sum(sizes.values()), (
        report
    )
    newer = [i for i in planned if i["vs_image"] == "newer"]
    assert report["prunable_unused_newer_bytes"] == sum(i["bytes"] for i in newer) > 0, report


@pytest.mark.parametrize(
    ("small", "tight"), [(3 << 20, True), (4 << 20, False)], indirect=["small"], ids=["tight", "room"]
)
def test_a_warm_job_says_before_anything_rolls_whether_both_generations_fit(
    small: Rollout, tight: bool
) -> None:
    r = small
    r.serve("old", 4, "old-1")
    job = r.pods.start("new-warm", argv(4), cache_root=r.root, command="warm",
                       env={**r.image("new"), "VLLM_RBLN_COMPILE_ONLY": "1"})  # fmt: skip
    assert job.wait_exit() == 0, job.tail()  # it only warns: its entry is published
    line, last = job.log.read_text().rstrip().splitlines()[-2:]
    assert last.startswith("warm: compiled entry "), last
    old_label, new_label = LABELS["sdk"]
    head = "warm: both generations fit, with little room left: " if tight else "warm: both generations fit: "
    assert line.startswith(f"{head}this generation ({new_label}) holds 1.0 MiB in 1 entry; the older ({old_label}) "
                           "1.0 MiB in 1 entry, in use by old-1; "), line  # fmt: skip
    (event,) = [e for e in job.log_events() if e.get("event") == "rollout_space"]
    assert event["tight"] is tight
    assert event["level"] == ("warning" if tight else "info")
    assert event["older"][0]["in_use_by"] == ["old-1"]
    if tight:
        assert "another compile for this role fails with exit 73 until space is freed" in line
        assert (
            "('cachemgr prune --incompatible --yes' once the old pods are gone, or raise storage.compileCache.size)"
            in line
        )


# --- an old pod's own pruning, and what a writer plants -------------------------------------------------


@pytest.mark.parametrize("rollout", ["sdk", "server"], indirect=True)
def test_an_old_images_prune_incompatible_keeps_a_newer_generation(rollout: Rollout) -> None:
    """The defect of issue 32: in a 0.12 pod after a 0.13 warm Job published, ``prune
    --incompatible`` removed the 0.13 entry (it compared compilers with !=)."""
    r = rollout
    r.warm("new", 4, "new-warm")
    (newer,) = entry_dirs(r.root)
    r.cli("old", "prune", "--incompatible", "--yes")
    assert newer.is_dir(), "the old image pruned the newer generation's entry"
    r.cli("old", "prune", "--superseded", "--yes")
    assert newer.is_dir()
    (row,) = [x for x in r.json("old", "ls")["items"] if x["kind"] == "entry"]
    assert row["status"] == "newer"
    assert row["problem"] == NEWER_WORDS[r.kind]


@pytest.mark.parametrize("rollout", ["sdk"], indirect=True)
def test_an_old_pods_auto_prune_never_removes_a_newer_generation(rollout: Rollout) -> None:
    """``--auto-prune incompatible`` in an old pod on a miss (a new configuration on the old
    image, mid-rollout): it compared compilers with != and removed the new image's entries."""
    r = rollout
    r.warm("new", 4, "new-warm")
    (newer,) = entry_dirs(r.root)
    pod = r.pods.start(
        "old-tp16", argv(16), cache_root=r.root, env=r.image("old"), options=["--auto-prune", "incompatible"]
    )
    pod.wait_phase("serving")
    assert newer.is_dir(), "the old pod removed the newer image's entry"
    assert not any(e.get("event") == "auto_pruned_incompatible" for e in pod.log_events())


@pytest.mark.parametrize("rollout", ["sdk"], indirect=True)
@pytest.mark.parametrize("damage", ["claims an older compiler", "a link", "a fifo", "garbage", "missing"])
def test_a_key_json_that_cannot_prove_its_generation_is_never_judged_older(
    rollout: Rollout, damage: str
) -> None:
    """A newer entry whose key.json a writer changed (it no longer hashes to its key), replaced by
    a link or a FIFO, filled with garbage or removed: its generation is unknown, so no image calls
    it older, and ls says why; nothing hangs."""
    r = rollout
    r.warm("new", 4, "new-warm")
    (entry,) = entry_dirs(r.root)
    key_json = entry / "key.json"
    os.chmod(entry, 0o755)
    doc = json.loads(key_json.read_text())
    key_json.unlink()
    if damage == "claims an older compiler":
        doc["inputs"]["compiler"] = "0.11"
        key_json.write_text(json.dumps(doc))
    elif damage == "a link":
        outside = r.root.parent / "outside.json"
        outside.write_text(json.dumps({**doc, "inputs": {**doc["inputs"], "compiler": "0.11"}}))
        key_json.symlink_to(outside)
    elif damage == "a fifo":
        os.mkfifo(key_json)
    elif damage == "garbage":
        key_json.write_bytes(b"\x00{not json")
    for which in ("old", "new"):
        done = subprocess.run(
            [sys.executable, "-m", "cachemgr", "ls", "-o", "json"], env=r.shell(which), capture_output=True,
            text=True, timeout=DEADLINE, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        (row,) = [x for x in json.loads(done.stdout)["items"] if x["kind"] == "entry"]
        assert row["status"] == "published"
        assert row["generation"] is None
        assert "its generation is unknown, so it is never judged older" in done.stderr
        plan = r.json(which, "prune", "--incompatible", "--superseded", "--dry-run")["plan"]
        assert plan["items"] == []
    assert entry.is_dir()


@pytest.mark.parametrize("rollout", ["sdk"], indirect=True)
def test_a_planted_scan_hint_never_makes_prune_remove_a_newer_entry(rollout: Rollout) -> None:
    """scan-hints.json is anyone's to write and only ls and du read it: a row claiming that the
    newer entry is of an older generation may mislead ls, never prune."""
    r = rollout
    r.warm("new", 4, "new-warm")
    (entry,) = entry_dirs(r.root)
    summary = json.loads((entry / "summary.json").read_text())
    lineage = ["hub", MODEL, "prefill", "RBLN-CA25", "vllm"]
    st = entry.stat()
    claimed = {"generation": [["compiler", "0.11"], ["schema", "1"]], "lineage": lineage}
    summary["key_facts"] = {"facts": json.dumps(claimed)}  # as a scan for ls writes what key.json says
    summary["_key_facts"] = "planted"  # the scan's own parsed field: never taken from a row
    hints = {
        "format": 1,
        "entries": {entry.name: {"stamp": [st.st_ino, st.st_mtime_ns, st.st_ctime_ns], "summary": summary}},
        "usage": {},
    }
    (r.root / "scan-hints.json").write_text(json.dumps(hints))
    (row,) = [x for x in r.json("new", "ls")["items"] if x["kind"] == "entry"]
    assert row["status"] == "incompatible", "the planted hint is what ls shows (the hints' own threat model)"
    assert r.json("new", "prune", "--incompatible", "--yes")["plan"]["items"] == []
    assert entry.is_dir()


def test_prune_remote_has_no_superseded(tmp_path: Path) -> None:
    """A bucket keeps no use records, and another cluster may still run the older server: the
    selector is refused before anything is listed, not ignored."""
    with cluster(tmp_path / "pods") as pods:
        done = subprocess.run(
            [sys.executable, "-m", "cachemgr", "prune", "--remote", "s3://bucket/prefix", "--superseded", "--dry-run"],
            env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(tmp_path)}, capture_output=True, text=True,
            timeout=DEADLINE, check=False, stdin=subprocess.DEVNULL,
        )  # fmt: skip
    assert done.returncode == 64, done.stderr
    assert "prune --remote has no --superseded" in done.stderr


@pytest.mark.parametrize("rollout", ["sdk"], indirect=True)
def test_explain_in_an_old_pod_compares_an_input_two_rules_name_differently_as_one(rollout: Rollout) -> None:
    """Issue 40: the newer image keys strictly (a release cachemgr was not checked against), with
    --model-impl among the serving flags; the old image's 0.12 rules key it as the model path.
    For the same argv, explain in an old pod reported "serving settings differ (--model-impl vllm
    -> (unset))" and "the model path differs": one input, named twice. It says the rules differ."""
    r = rollout
    impl = ["--model-impl", "vllm"]
    env = {**r.image("new"), "VLLM_RBLN_COMPILE_ONLY": "1"}
    job = r.pods.start("new-warm", [*argv(4), *impl], cache_root=r.root, command="warm", env=env)
    assert job.wait_exit() == 0, job.tail()
    result = r.json("old", "explain", "--", *argv(4), *impl, code=1)
    (near,) = result["nearest"]
    fields = {d["field"] for d in near["differences"]}
    assert "rules" in fields, fields
    assert not {"model_impl", "serving.model_impl"} & fields, near["differences"]
    assert near["renamed"] == [{"entry_field": "serving.model_impl", "field": "model_impl", "value": "vllm"}]
    advice = "\n".join(result["advice"])
    assert "serving settings differ" not in advice, advice
    assert "the model path differs" not in advice, advice
    assert "the two rules differ in what they key and in what they call it" in advice, advice
    assert "(serving.model_impl there is model_impl here, vllm in both: not a difference)" in advice, advice
    # Another value is one difference, under this image's name for it.
    result = r.json("old", "explain", "--", *argv(4), "--model-impl", "optimum", code=1)
    (near,) = result["nearest"]
    (changed,) = [d for d in near["differences"] if d["field"].endswith("model_impl")]
    assert changed == {"field": "model_impl", "entry": "vllm", "here": "optimum"}, near["differences"]


# --- helm rollback, and the room for two generations (docs/operator-guide.md, issue 40) ------------


@pytest.mark.parametrize("rollout", ["sdk"], indirect=True)
def test_a_rollback_hits_the_old_entries_and_after_a_prune_compiles_each_once(rollout: Rollout) -> None:
    """The guide's "Rolling back", statement by statement: a rollback before the prune hits the old
    entries (nothing compiles); after 'prune --incompatible' the old image compiles each key once
    again (its pods share the compile); pods with --on-miss fail exit 69 until the old image's
    warm Job (or one old pod) has compiled; the new image's entries stay, "newer" to the old one."""
    r = rollout
    stop(r.serve("old", 4, "old-1"))
    r.warm("new", 4, "new-warm")
    new_1 = r.serve("new", 4, "new-1")
    before = r.pods.compiles()
    back = r.serve("old", 4, "rollback-1")  # the rollback: an old pod, the old entry still there
    assert r.pods.compiles() == before, "a rollback before the prune compiles nothing"
    stop(back)
    assert "removed 1 item of 1" in r.cli("new", "prune", "--incompatible", "--yes")
    # The rollback after the prune: onMiss=fail pods stop with 69 (a miss) ...
    failing = r.pods.start("rollback-fail", argv(4), cache_root=r.root, options=["--on-miss", "fail"],
                           env=r.image("old"))  # fmt: skip
    assert failing.wait_exit() == 69, failing.tail()
    assert "cachemgr warm" in termination(failing), termination(failing)
    # ... until the old image's warm Job compiles the key, once; then every old pod hits it.
    r.warm("old", 4, "rollback-warm")
    assert r.pods.compiles() == before + 1
    r.serve("old", 4, "rollback-2")
    served = r.pods.start("rollback-3", argv(4), cache_root=r.root, options=["--on-miss", "fail"],
                          env=r.image("old"))  # fmt: skip
    served.wait_phase("serving")
    assert r.pods.compiles() == before + 1, "one compile for the rollback"
    assert new_1.proc.poll() is None, "the new pod serves on"
    assert "nothing to prune" in r.cli("old", "prune", "--incompatible", "--superseded", "--yes")
    assert "newer: compiler 0.13" in r.cli("old", "ls"), "the new image's entry stays for the next upgrade"


@pytest.mark.parametrize("small", [5 << 19], indirect=True)
def test_a_volume_of_two_generations_and_room_holds_a_rollout(small: Rollout) -> None:
    """The guide's "How large for two generations": while old pods serve, the volume holds the old
    generation's entries and the new one's beside them. With room for both (here 2.5 MiB for two
    entries of 1.0 MiB) the warm Job fits and says so; 1.5 MiB did not (exit 73, above)."""
    r = small
    r.serve("old", 4, "old-1")
    line = r.warm("new", 4, "new-warm")
    assert line.startswith("warm: both generations fit"), line
    r.serve("new", 4, "new-1")
