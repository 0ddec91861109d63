"""One format on one stream (issue 34, item 1): the rule docs/reference.md states, held with real
processes, no terminal, and the pod's ``CACHEMGR_LOG_FORMAT=json`` (the chart sets it for the whole
pod, so a person's ``kubectl exec`` inherits it):

* ``run``, ``warm`` and ``probe`` write the pod's log: in JSON every line cachemgr writes on
  stderr is a JSON event (notes, warnings, the ``failed`` event, a traceback inside it);
* every other command is a person's unless asked: plain ``note:``/``warning:`` lines and the
  plain ``cachemgr COMMAND: ...`` error, whatever the pod's format; with ``-o json`` (or ``-o
  yaml``, or ``--log-format json``) every stderr line is a JSON event, so both streams parse.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit import terminal
from cachemgr_testkit.podlib import DEADLINE, Cluster, free_port, run_cli
from cachemgr_testkit.scenarios import server_argv

SERVER = ["vllm", "serve", "MiniMaxAI/MiniMax-M2.7", "--tensor-parallel-size", "4"]
# Inspection commands on a directory no pod used (each prints the note that says so) with the
# exit code each has there: a not-found, a miss, a refusal, or a plain answer.
PERSON_COMMANDS: list[tuple[list[str], int]] = [
    (["ls"], 0),
    (["show", "0123abcd"], 66),
    (["explain", "--", *SERVER], 1),
    (["du"], 0),
    (["verify"], 0),
    (["prune", "--incompatible", "--yes"], 0),
    (["prune"], 64),
    (["locks"], 0),
    (["stats"], 0),
    (["key", "--", *SERVER], 0),
    (["ls", "--bogus"], 64),
]


def pod_env(pods: Cluster, root: Path, **more: str) -> dict[str, str]:
    return {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), "CACHEMGR_LOG_FORMAT": "json", **more}


def json_events(stderr: str) -> list[dict[str, Any]]:
    """Every line of ``stderr`` as a JSON event; fails naming the first line that is not one."""
    events = []
    for line in stderr.splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            raise AssertionError(f"a line that is not JSON on a JSON stderr: {line!r}\n{stderr}") from None
        assert isinstance(event, dict), line
        assert "event" in event, line
        events.append(event)
    return events


def with_output(args: list[str], *form: str) -> list[str]:
    cut = args.index("--") if "--" in args else len(args)
    return [*args[:cut], *form, *args[cut:]]


@pytest.mark.parametrize(
    ("args", "code"), PERSON_COMMANDS, ids=lambda a: " ".join(a) if isinstance(a, list) else ""
)
def test_an_inspection_command_prints_for_a_person_whatever_the_pods_format(
    pods: Cluster, tmp_path: Path, args: list[str], code: int
) -> None:
    empty = tmp_path / "not-the-volume"
    empty.mkdir()
    done = run_cli(*args, env=pod_env(pods, empty))
    assert done.returncode == code, done.stderr
    lines = done.stderr.splitlines()
    assert lines, "each of these has something to say on stderr here"
    plain = ("note: ", "warning: ", f"cachemgr {args[0]}: ")
    # A note or a warning wider than the terminal (80 columns without one) continues two in.
    said = [line for i, line in enumerate(lines) if not (line.startswith("  ") and i and lines[i - 1])]
    assert [line for line in said if not line.startswith(plain)] == [], done.stderr
    # ... and fits 80 columns but for a word longer than the room (a path), kept whole beside its label.
    wide = [line for line in lines if len(line) > 80 and not line.startswith(f"cachemgr {args[0]}: ")]
    assert all(len(line.split()) <= 2 for line in wide), done.stderr
    if code not in (0, 1):
        assert lines[-1].startswith(f"cachemgr {args[0]}: "), "the error, once, as the last line"


@pytest.mark.parametrize(
    ("args", "code"), PERSON_COMMANDS, ids=lambda a: " ".join(a) if isinstance(a, list) else ""
)
@pytest.mark.parametrize("form", [["-o", "json"], ["-o", "yaml"], ["--log-format", "json"]], ids=" ".join)
def test_asked_for_json_every_line_on_stderr_is_an_event(
    pods: Cluster, tmp_path: Path, args: list[str], code: int, form: list[str]
) -> None:
    empty = tmp_path / "not-the-volume"
    empty.mkdir()
    env = {**pod_env(pods, empty), "CACHEMGR_LOG_FORMAT": "console"}  # the pod's format: not asked
    done = run_cli(*with_output(args, *form), env=env)
    assert done.returncode == code, done.stderr
    events = json_events(done.stderr)
    if args[0] != "key" and code != 64:  # a usage error is said before the volume is looked at
        (note,) = [e for e in events if "cachemgr-layout.json" in e.get("message", "")]
        assert (note["event"], note["level"]) == ("note", "info"), note
    if code not in (0, 1):
        assert [e["event"] for e in events][-1] == "failed", events
        assert events[-1]["exit_code"] == code
    if form[:2] == ["-o", "json"] and code in (0, 1):
        json.loads(done.stdout)  # and the result parses too


def test_run_warm_and_probe_write_the_pods_json_only(pods: Cluster, tmp_path: Path) -> None:
    root = tmp_path / "volume"
    root.mkdir()
    env = pod_env(pods, root)
    quiet = "sh -c 'mkdir -p {output_dir}/m && head -c 4096 /dev/zero > {output_dir}/m/model.bin'"
    options = ["--strategy", "command", "--compile-cmd", quiet, "--key-env", "CACHEMGR_TEST_KEYED"]
    # A warm that compiles and publishes, one that finds the entry, one whose compile fails, one
    # that cannot start: each line they write is an event.
    for extra, code in (
        ([], 0),
        ([], 0),
        (["--compile-cmd", "sh -c 'exit 3' {output_dir}"], 70),
        (["--on-miss", "never"], 64),
    ):
        done = run_cli("warm", *options, *extra, "--", *server_argv(free_port()), env=env)
        assert done.returncode == code, done.stderr
        events = json_events(done.stderr)
        if code:
            assert events[-1]["event"] == "failed", events
    # A probe with no run behind it passes or fails on stdout; its usage error is the pod's event.
    done = run_cli("probe", "sideways", env=env)
    assert done.returncode == 64
    (event,) = json_events(done.stderr)
    assert (event["event"], event["command"], event["exit_code"]) == ("failed", "probe", 64)


def on_pty(*args: str, env: dict[str, str]) -> tuple[int, str]:
    """``cachemgr ARGS`` with stdin, stdout and stderr on one pseudo-terminal, as ``kubectl exec -it``."""
    return terminal.on_pty([sys.executable, "-m", "cachemgr", *args], env, deadline=DEADLINE)


def test_on_a_terminal_a_pod_command_in_json_stays_json_and_a_persons_stays_plain(
    pods: Cluster, tmp_path: Path
) -> None:
    """``kubectl exec -it`` into a pod: ``warm`` keeps the pod's JSON (it is the pod's log, one
    format whoever reads it); ``show`` prints for the person at the terminal, as without one."""
    empty = tmp_path / "not-the-volume"
    empty.mkdir()
    env = pod_env(pods, empty)
    code, shown = on_pty("warm", "--on-miss", "never", "--", *SERVER, env=env)
    assert code == 64
    (line,) = shown.strip().splitlines()
    assert json.loads(line)["event"] == "failed", line
    code, shown = on_pty("show", "0123abcd", env=env)
    assert code == 66
    assert all(not line.startswith("{") for line in shown.strip().splitlines()), shown
