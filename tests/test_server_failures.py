"""An entry the server cannot load (issue 26 item 4): each pre-ready server exit on a hit is recorded
beside the entry and seen (ls, show, explain, the termination message); prune --key removes one local
entry; --on-server-failure set-aside-after N compiles afresh once, and never loops.

Real pods (the stand-in server made to die after loading a cached entry: STANDIN_EXIT_ON_LOAD), real
files on the volume, the real CLI.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, metrics, run_cli, wait_for
from cachemgr_testkit.scenarios import (
    command_key,
    compile_cmd,
    entry_dirs,
    served_entry,
    server_argv,
    vllm_argv,
)

from cachemgr.cli.errors import _termination_text
from cachemgr.runtime import failures
from cachemgr.volume import serverfail


def _env(pods: Cluster, root: Path) -> dict[str, str]:
    return {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}


def _fail(pods: Cluster, root: Path, name: str, code: str, *, options: tuple[str, ...] = ()) -> int:
    pod = pods.start(
        name, vllm_argv(free_port()), cache_root=root, options=options, env={"STANDIN_EXIT_ON_LOAD": code}
    )
    return pod.wait_exit()


def _key(entry: Path) -> str:
    return str(json.loads((entry / "summary.json").read_text())["key"])


def test_each_pre_ready_exit_on_a_hit_is_recorded_and_seen_everywhere(pods: Cluster, root: Path) -> None:
    entry = served_entry(pods, root)
    key = _key(entry)
    assert _fail(pods, root, "bad-1", "3") == 3, "the pod exits with the server's own code"
    term = (pods.work / "pods" / "bad-1" / "termination-log").read_text()
    assert f"cachemgr prune --key {key[:12]} --yes" in term
    assert "exited with code 3 before it was ready" in term
    assert _fail(pods, root, "bad-2", "-9") == 137
    assert "was killed by SIGKILL" in (pods.work / "pods" / "bad-2" / "termination-log").read_text()

    records = sorted((root / "usage" / key).glob("server-failed.*"))
    assert len(records) == 2
    docs = [json.loads(p.read_text()) for p in records]
    assert {d["pod"] for d in docs} == {"bad-1", "bad-2"}
    assert {(d["exit_status"], d["signal"]) for d in docs} == {(3, None), (137, "SIGKILL")}
    assert all(any("cannot load the compiled model" in line for line in d["last_lines"]) for d in docs)

    env = _env(pods, root)
    listed = json.loads(run_cli("ls", "-o", "json", env=env).stdout)["items"]
    (row,) = [r for r in listed if r.get("kind") == "entry"]
    assert row["server_failed"] == 2
    assert row["status"] == "published"
    table = run_cli("ls", env=env).stdout
    assert "server-failed 2" in table
    assert "prune --key KEY --yes" in table
    shown = run_cli("show", key[:12], env=env).stdout
    assert "SERVER EXITED BEFORE READY (2)" in shown
    assert "server-failed 2" in shown
    assert "killed by SIGKILL (137)" in shown
    assert "exit code 3" in shown
    assert "RuntimeError: [standin] cannot load the compiled model" in shown
    explained = run_cli("explain", "--", *vllm_argv(free_port()), env=env)
    assert "exited before it was ready 2 times" in " ".join(explained.stdout.split())
    assert f"cachemgr prune --key {key[:12]} --yes" in explained.stdout
    # Both commands it names work as printed: the key, not a placeholder.
    assert f"'cachemgr show {key[:12]}' has the last lines" in explained.stdout, explained.stdout

    # A good start afterwards still serves: recording changes nothing by default.
    good = pods.start("good", vllm_argv(free_port()), cache_root=root)
    good.wait_phase("serving")
    assert pods.compiles() == 1


def test_a_hit_whose_server_starts_never_imports_the_server_failure_code(pods: Cluster, root: Path) -> None:
    """The records are read and written only for a server that failed: a good hit pays nothing."""
    served_entry(pods, root)
    pod = pods.start("hit", vllm_argv(free_port()), cache_root=root, env={"PYTHONPROFILEIMPORTTIME": "1"})
    pod.wait_phase("serving")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 0
    imported = {line.rsplit("|", 1)[-1].strip() for line in pod.log.read_text().splitlines() if "|" in line}
    assert "cachemgr.runtime.launch" in imported, "the log holds the pod's import report"
    assert not {"cachemgr.runtime.server_failures", "cachemgr.volume.serverfail"} & imported


def test_prune_key_removes_one_local_entry_and_never_one_in_use(pods: Cluster, root: Path) -> None:
    entry = served_entry(pods, root)
    key = _key(entry)
    env = _env(pods, root)
    refused = run_cli("prune", "--yes", env=env)
    assert refused.returncode == 64
    assert "--key" in refused.stderr
    assert run_cli("prune", "--key", "ffffffff", "--yes", env=env).returncode == 66

    live = pods.start("live", vllm_argv(free_port()), cache_root=root)
    live.wait_phase("serving")
    kept = run_cli("prune", "--key", key[:8], "--yes", env=env)
    assert kept.returncode == 0, kept.stderr
    assert "in use by live" in " ".join(kept.stdout.split())
    assert entry.is_dir()
    live.signal(signal.SIGTERM)
    assert live.wait_exit() == 0

    done = run_cli("prune", "--key", key[:8], "--yes", env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.index("plan: 1 item") < done.stdout.index("removed 1 item of 1")
    assert "named (--key)" in done.stdout
    assert entry_dirs(root) == []


def test_set_aside_after_n_exits_from_any_pods_compiles_afresh_once(pods: Cluster, root: Path) -> None:
    entry = served_entry(pods, root)
    policy = ("--on-server-failure", "set-aside-after", "2")
    assert _fail(pods, root, "bad-1", "3") == 3
    # One recorded exit: below N, so this pod (with the policy) still uses the entry, and fails.
    assert _fail(pods, root, "bad-2", "3", options=policy) == 3
    assert pods.compiles() == 1
    fresh = pods.start("fresh", vllm_argv(free_port()), cache_root=root, options=policy)
    fresh.wait_phase("serving")
    assert pods.compiles() == 2, "set aside, compiled afresh"
    assert [p for p in (root / "quarantine").iterdir() if p.is_dir() and p.name.startswith(entry.name)]
    events = [e for e in fresh.log_events() if e["event"] == "entry_set_aside"]
    assert len(events) == 1
    assert "set-aside-after 2" in events[0]["reason"]
    listed = json.loads(run_cli("ls", "-o", "json", env=_env(pods, root)).stdout)["items"]
    (row,) = [r for r in listed if r.get("kind") == "entry"]
    assert row["server_failed"] == 0, "the fresh copy starts with no recorded exits"


def test_set_aside_never_loops_when_a_fresh_compile_fails_the_same_way(pods: Cluster, root: Path) -> None:
    """The command strategy: the pod compiles, then launches its server on the entry it published."""
    record = pods.work / "compiler.jsonl"
    command = ("--strategy", "command", "--compile-cmd", compile_cmd(record))
    policy = (*command, "--on-server-failure", "set-aside-after", "1")
    fault = {"STANDIN_EXIT_ON_LOAD": "3"}
    first = pods.start("first", server_argv(free_port()), cache_root=root, options=command, env=fault)
    assert first.wait_exit() == 3
    second = pods.start("second", server_argv(free_port()), cache_root=root, options=policy, env=fault)
    assert second.wait_exit() == 3
    term = (second.state_dir / "termination-log").read_text()
    assert "the entry is not the cause" in term.lower()
    assert len([e for e in second.log_events() if e["event"] == "entry_set_aside"]) == 1
    third = pods.start("third", server_argv(free_port()), cache_root=root, options=policy, env=fault)
    assert third.wait_exit() == 3
    assert [e for e in third.log_events() if e["event"] == "server_failure_not_set_aside"]
    assert not [e for e in third.log_events() if e["event"] == "entry_set_aside"]
    compiled = [json.loads(line) for line in record.read_text().splitlines()]
    assert len([e for e in compiled if e["event"] == "compile"]) == 2, "compiled afresh once, not again"


def test_a_bad_policy_is_one_line_with_its_code(pods: Cluster, root: Path) -> None:
    env = {**_env(pods, root), "CACHEMGR_ON_SERVER_FAILURE": "set-aside-after many"}
    done = run_cli("run", "--", *vllm_argv(free_port()), env=env)
    assert done.returncode == 78
    assert "CACHEMGR_ON_SERVER_FAILURE" in done.stderr
    flag = run_cli(
        "run", "--on-server-failure", "sometimes", "--", *vllm_argv(free_port()), env=_env(pods, root)
    )
    assert flag.returncode == 64
    assert "--on-server-failure" in flag.stderr


def test_records_are_hostile_ground_bounded_escaped_and_skipped(pods: Cluster, root: Path) -> None:
    entry = served_entry(pods, root)
    key = _key(entry)
    env = _env(pods, root)
    folder = root / "usage" / key
    instance = serverfail.instance_of(json.loads((entry / "summary.json").read_text())["created_at"])
    planted = {
        "pod": "evil\x1b[2J\nfake row",
        "node": "n",
        "time": 1.0,
        "exit_status": 1,
        "last_lines": ["\x1b[31mred\x1b[0m", "ok"],
    }
    (folder / f"{serverfail.PREFIX}{instance}.1.evil.1").write_text(json.dumps(planted))
    (folder / f"{serverfail.PREFIX}{instance}.2.big.1").write_bytes(b"{" + b" " * (1 << 20) + b"}")
    (folder / f"{serverfail.PREFIX}{instance}.3.notjson.1").write_text("nope")
    os.mkfifo(folder / f"{serverfail.PREFIX}{instance}.4.fifo.1")
    (folder / f"{serverfail.PREFIX}{instance}.5.link.1").symlink_to("/etc/passwd")
    shown = run_cli("show", key[:12], env=env, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert "\x1b" not in shown.stdout
    assert "evil\\x1b[2J\\nfake row" in shown.stdout
    assert "\\x1b[31mred" in shown.stdout
    assert "SERVER EXITED BEFORE READY (1)" in shown.stdout, "only the well-formed record counts as one"
    for reason in ("larger than", "not JSON", "not a regular file"):
        assert reason in shown.stderr, (reason, shown.stderr)
    listed = json.loads(run_cli("ls", "-o", "json", env=env, timeout=30).stdout)["items"]
    (row,) = [r for r in listed if r.get("kind") == "entry"]
    assert row["server_failed"] == 1, "planted names are not records: ls counts what show lists"


def test_writers_bound_lines_records_and_the_count(root: Path) -> None:
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import open_root

    cache = open_root(root, create=True)
    who = PodIdentity(pod="p", node="n", pid=1, host="h")
    for _ in range(serverfail.KEEP_BEFORE + 2):  # a copy before, set aside: its newest are kept as evidence
        serverfail.write(
            cache, "k" * 32, who, instance="old", entry="e", exit_status=1, signal_name=None,
            last_lines=["x"], compiled_here=False,
        )  # fmt: skip
    for _ in range(serverfail.KEEP + 5):
        serverfail.write(
            cache, "k" * 32, who, instance="abc", entry="e", exit_status=1, signal_name=None,
            last_lines=["é" * 10_000] * 100, compiled_here=False,
        )  # fmt: skip
    names = [p for p in (root / "usage" / ("k" * 32)).iterdir() if p.name.startswith(serverfail.PREFIX)]
    assert len(names) == serverfail.KEEP + serverfail.KEEP_BEFORE
    assert all(p.stat().st_size <= serverfail.RECORD_MAX for p in names)
    got = serverfail.read(cache, "k" * 32)
    assert len(got.of("abc")) == serverfail.KEEP
    assert len(got.before("abc")) == serverfail.KEEP_BEFORE
    assert not got.notes
    assert all(len(line) <= serverfail.LINE_MAX for f in got.failures for line in f.last_lines)


def test_a_read_only_volume_records_nothing_and_says_so(
    pods: Cluster, root: Path, readonly_bind: Callable[[Path], Path]
) -> None:
    entry = served_entry(pods, root)
    ro = readonly_bind(root)
    pod = pods.start("ro", vllm_argv(free_port()), cache_root=ro, env={"STANDIN_EXIT_ON_LOAD": "3"})
    assert pod.wait_exit() == 3
    assert not list((root / "usage" / _key(entry)).glob("server-failed.*"))
    assert [e for e in pod.log_events() if e["event"] == "server_failure_not_recorded"]
    assert "cachemgr prune --key" in (pod.state_dir / "termination-log").read_text()


def test_the_pods_metrics_count_it_across_a_container_restart(pods: Cluster, root: Path) -> None:
    served_entry(pods, root)
    port = free_port()
    bad = pods.start(
        "pod", vllm_argv(free_port()), cache_root=root, options=("--status-port", str(port)),
        env={"STANDIN_EXIT_ON_LOAD": "3"},
    )  # fmt: skip
    assert bad.wait_exit() == 3
    assert bad.state()["phase"] == "failed"
    # The restarted container: the same pod-local state dir, the server fixed.
    again = pods.start(
        "pod-restarted", vllm_argv(free_port()), cache_root=root, options=("--status-port", str(port)),
        env={"CACHEMGR_STATE_DIR": str(bad.state_dir)},
    )  # fmt: skip
    wait_for(lambda: bad.state().get("phase") == "serving", what="the restarted pod to serve")
    assert again.proc.poll() is None
    assert metrics(port)["cachemgr_failures_total{reason=server-failed}"] == 1


# --- the adversarial pass: planted names, old evidence, planted links, odd digits ------------------


def test_planted_names_claiming_the_future_never_push_out_a_real_record(root: Path) -> None:
    from cachemgr.volume.identity import PodIdentity
    from cachemgr.volume.layout import open_root

    cache = open_root(root, create=True)
    digest = "d" * 32
    folder = root / "usage" / digest
    folder.mkdir(parents=True)
    for n in range(serverfail.KEEP):  # junk that sorts as the newest of this copy
        (folder / f"{serverfail.PREFIX}abc.{'f' * 40}.junk.{n}").write_text("junk")
    who = PodIdentity(pod="p", node="n", pid=1, host="h")
    name = serverfail.write(
        cache, digest, who, instance="abc", entry="e", exit_status=3, signal_name=None,
        last_lines=["boom"], compiled_here=False,
    )  # fmt: skip
    assert (folder / name).is_file(), "the record just written stays"
    got = serverfail.read(cache, digest)
    assert [f.exit_status for f in got.of("abc")] == [3]


def test_an_old_failure_of_an_earlier_copy_does_not_block_setting_aside(pods: Cluster, root: Path) -> None:
    """A copy that failed with exit 3 long ago is no evidence against today's copy failing with 3."""
    entry = served_entry(pods, root)
    key = _key(entry)
    folder = root / "usage" / key
    long_ago = {
        "pod": "old",
        "node": "n",
        "time": 1.0,
        "exit_status": 3,
        "compiled_here": True,
        "last_lines": [],
    }
    (folder / f"{serverfail.PREFIX}oldcopy.1.old.1").write_text(json.dumps(long_ago))
    policy = ("--on-server-failure", "set-aside-after", "1")
    assert _fail(pods, root, "bad-1", "3") == 3
    fresh = pods.start("fresh", vllm_argv(free_port()), cache_root=root, options=policy)
    fresh.wait_phase("serving")
    assert [e for e in fresh.log_events() if e["event"] == "entry_set_aside"], fresh.tail()


def test_a_link_planted_as_the_usage_folder_never_stops_a_hit_under_the_policy(
    pods: Cluster, root: Path, tmp_path: Path
) -> None:
    entry = served_entry(pods, root)
    folder = root / "usage" / _key(entry)
    for record in folder.iterdir():
        record.unlink()
    folder.rmdir()
    (tmp_path / "elsewhere").mkdir()
    folder.symlink_to(tmp_path / "elsewhere")
    policy = ("--on-server-failure", "set-aside-after", "1")
    pod = pods.start("hit", vllm_argv(free_port()), cache_root=root, options=policy)
    pod.wait_phase("serving")
    assert [e for e in pod.log_events() if e["event"] == "server_failure_policy_skipped"], pod.tail()
    assert list((tmp_path / "elsewhere").iterdir()) == [], "nothing written through the link"


def test_a_policy_count_in_other_digits_is_refused_not_a_crash(pods: Cluster, root: Path) -> None:
    env = {**_env(pods, root), "CACHEMGR_ON_SERVER_FAILURE": "set-aside-after \u00b3"}
    done = run_cli("run", "--", *vllm_argv(free_port()), env=env)
    assert (done.returncode, "Traceback" in done.stderr) == (78, False), done.stderr
    flag = run_cli(
        "run", "--on-server-failure", "set-aside-after", "\u00b2", "--", *vllm_argv(free_port()),
        env=_env(pods, root),
    )  # fmt: skip
    assert (flag.returncode, "Traceback" in flag.stderr) == (64, False), flag.stderr


def _loading_server(pods: Cluster, root: Path, name: str, **env: str) -> tuple[Pod, psutil.Process]:
    """A pod on a hit whose server loads for ten minutes (never ready), and that server."""
    pod = pods.start(
        name, vllm_argv(free_port()), cache_root=root, env={"STANDIN_LOAD_SECONDS": "600", **env}
    )
    pod.wait_phase("launching")
    me = psutil.Process(pod.proc.pid)
    found = wait_for(me.children, timeout=30, what="the server process")
    wait_for(lambda: _catches_sigterm(found[0].pid), timeout=30, what="the server's SIGTERM handler")
    return pod, found[0]


def _catches_sigterm(pid: int) -> bool:
    """The process has its own SIGTERM handler (the stand-in server, past its start-up)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)
    return False


def test_a_server_dead_before_the_pods_sigterm_is_said_though_the_signal_came_before_the_pod_looked(
    pods: Cluster, root: Path
) -> None:
    """Issue 40's flaky campaign invariant, made to happen on purpose: the server dies before ready
    (here the OOM killer's SIGKILL), and the rollout's SIGTERM reaches the pod after that death but
    before the pod has looked at it (its main thread frozen in between, as a busy node delays it).
    The death is the server's own: the termination message says it. Before, any SIGTERM set before
    the pod looked made it a stop, and the message was empty."""
    served_entry(pods, root)
    pod, server = _loading_server(pods, root, "dies")
    pod.signal(signal.SIGSTOP)  # cachemgr alone: the server loads on
    try:
        server.send_signal(signal.SIGKILL)
        wait_for(lambda: server.status() == psutil.STATUS_ZOMBIE, timeout=10, what="the server to die")
        pod.signal(signal.SIGTERM)  # pending until the pod runs again: after the death
    finally:
        pod.signal(signal.SIGCONT)
    assert pod.wait_exit() == 137, pod.tail()
    term = (pod.state_dir / "termination-log").read_text()
    assert "was killed by SIGKILL (exit 137) before it was ready" in term, term
    [record] = (root / "usage").glob("*/server-failed.*")
    assert json.loads(record.read_text())["signal"] == "SIGKILL"
    assert "stopped_by" not in pod.state().get("detail", {}), pod.state()


def test_a_server_that_exits_on_the_pods_sigterm_is_a_stop_whatever_its_code(
    pods: Cluster, root: Path
) -> None:
    """The other side of the rule: the SIGTERM reached the server while it ran, and it exited with
    a code of its own choosing (3): the pod was stopped, its entry is not blamed."""
    served_entry(pods, root)
    pod, server = _loading_server(pods, root, "stopped", STANDIN_EXIT_CODE="3")
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 128 + signal.SIGTERM, pod.tail()  # a stop before serving: the stop's code
    term = pod.state_dir / "termination-log"
    assert not term.exists() or "before it was ready" not in term.read_text()
    assert list((root / "usage").glob("*/server-failed.*")) == []
    assert not server.is_running() or server.status() == psutil.STATUS_ZOMBIE
    # Said in the state: the fault campaign tells such a stop from a death by it (the code cannot).
    assert pod.state()["detail"] == {"exit_code": 143, "stopped_by": "SIGTERM", "server_exit_code": 3}


def test_a_server_that_refuses_its_configuration_on_a_miss_says_why_in_the_termination_message(
    pods: Cluster, root: Path
) -> None:
    """Issue 38: in front of the real vllm serve, a server that refused its flags ended the pod with
    "the server exited with code 1" and nothing of what it said; its last lines now follow, escaped,
    as on a hit. The stand-in refuses a knob it cannot read the same way (its one-line error)."""
    pod = pods.start(
        "a", vllm_argv(free_port()), cache_root=root, env={"STANDIN_EXIT_BEFORE_HEALTHY": "\x1b[31mx"}
    )
    assert pod.wait_exit() == 70
    message = (pod.state_dir / "termination-log").read_text()
    head, _, tail = message.partition("\nlast lines of the server's output:\n")
    assert "the server exited with code" in head
    assert "STANDIN_EXIT_BEFORE_HEALTHY" in tail, message
    assert "\x1b" not in message, "the server's output reaches the termination message escaped"
    assert entry_dirs(root) == []


@pytest.mark.quick
def test_the_termination_message_of_a_hit_says_what_the_server_raised_above_its_last_lines() -> None:
    """A server that fails on a hit as the real vLLM fails (its root cause tens of lines above its
    end): the message names what it raised, escaped and cut, once, before its last lines; an
    exception the last lines show already is not said twice."""
    wrapper = "RuntimeError: Engine core initialization failed. See root cause above."
    tail = [f'(APIServer pid=1)   File "f{i}.py", line {i}, in g' for i in range(19)]
    tail.append(f"(APIServer pid=1) {wrapper}")
    cause = (
        "safetensors._safetensors_rust.SafetensorError: \x1b[31mError while deserializing header " + "x" * 500
    )
    error = failures.server_failed(1, key=command_key(), entry="e", last_lines=tail, raised=[cause, wrapper])
    message = _termination_text(error, error.one_line())
    head, _, rest = message.partition("\nthe server raised:\n")
    said, _, last = rest.partition("\nlast lines of the server's output:\n")
    assert head == error.one_line()
    assert said.startswith("safetensors._safetensors_rust.SafetensorError: \\x1b[31mError while"), said
    assert "\n" not in said, "one line: the wrapper, in the last lines, is not repeated"
    assert len(said) < 400
    assert last.splitlines()[-1].endswith(wrapper)
    assert "\x1b" not in message


@pytest.mark.quick
def test_show_says_what_a_failed_compiles_server_raised_from_a_record_read_as_hostile() -> None:
    """The failure record keeps what the server raised (its root cause lies above the tail);
    ``show`` prints at most what a pod records, each cut and escaped, whatever a writer planted."""
    from cachemgr.cli.cmd_show import _failure_text

    planted = {
        "reason": "compile-failed",
        "message": "the server exited with code 1",
        "output_tail": ["RuntimeError: Engine core initialization failed. See root cause above."],
        "raised": [
            "SafetensorError: \x1b[2Jbad header " + "y" * 1000,
            "RuntimeError: Engine core initialization failed. See root cause above.",
            *(f"ValueError: planted {i}" for i in range(100)),
        ],
    }
    text = _failure_text(planted)
    _, _, said = text.partition("  the server raised:\n")
    said_lines = said.partition("  last output:")[0].splitlines()
    assert said_lines[0].startswith("    ! SafetensorError: \\x1b[2Jbad header"), said_lines
    assert len(said_lines[0]) < 400
    assert said_lines[1:] == ["    ! ValueError: planted 0", "    ! ValueError: planted 1"], (
        "the first 4, minus the tail's"
    )
    assert "\x1b" not in text
    assert _failure_text({**planted, "raised": "not a list"}).count("raised") == 0


def test_a_line_the_server_leaves_open_on_stderr_never_has_an_event_spliced_onto_it(
    pods: Cluster, root: Path
) -> None:
    """A server that dies (or is frozen, or killed) mid-line leaves its last line open on the
    stream cachemgr's own events go to: the next event was written onto that line, and neither
    read as a line of JSON (the deaf-server test saw its server_killed event lost that way)."""
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    server = ["sh", "-c", "printf 'half a line' >&2; exit 3", "{artifact_dir}"]
    job = pods.start("warm", server, cache_root=root, command="warm", options=options)
    assert job.wait_exit() == 0, job.tail()
    pod = pods.start("dies", server, cache_root=root, options=options)
    assert pod.wait_exit() == 3, pod.tail()
    lines = pod.log.read_text(errors="replace").splitlines()
    assert "half a line" in lines, pod.tail()
    after = lines[lines.index("half a line") + 1 :]
    assert after, pod.tail()
    assert [json.loads(line)["event"] for line in after][-1] == "phase", pod.tail()  # its stop, whole
