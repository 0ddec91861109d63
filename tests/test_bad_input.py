"""Bad input of any kind: one short line on stderr, a documented exit code, never a traceback.

Each case runs the real CLI as a subprocess, as an operator or a pod spec would, with console
logs (a failing ``run`` also logs its phase change to ``failed``: that line is a log event,
told apart by its timestamp and level; the message is the one line starting ``cachemgr``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cachemgr_standin import DECLARED_VERSIONS

_LOG_EVENT = re.compile(r"\d{4}-\d\d-\d\dT\S+ \[(info|warning|error)")  # a console log line
MESSAGE_LIMIT = 1000  # characters: a message is one readable line, whatever the input's size


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    root = tmp_path / "volume"
    root.mkdir()
    return {
        **os.environ,
        "CACHEMGR_CACHE_ROOT": str(root),
        "CACHEMGR_STATE_DIR": str(tmp_path / "state"),
        "CACHEMGR_TERMINATION_LOG": str(tmp_path / "termination-log"),
        "CACHEMGR_COMPILER_VERSION": "0.12.0",
        "CACHEMGR_NPU_TYPE": "RBLN-CA25",
        "CACHEMGR_ROLE": "prefill",
        "CACHEMGR_LOG_FORMAT": "console",
        **DECLARED_VERSIONS,  # the stand-in's vllm, vllm-rbln and optimum-rbln (not installed here)
    }


def cli(args: list[str | bytes], env: dict[str, str], *, timeout: float = 20) -> tuple[int, str]:
    """Run ``cachemgr ARGS``; return the exit code and the one message line, checked."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", *args], env=env, capture_output=True, timeout=timeout,
        check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    stderr = done.stderr.decode("utf-8", "replace")
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "internal error" not in stderr, stderr[-3000:]
    messages = [line for line in stderr.splitlines() if line.startswith("cachemgr")]
    assert len(messages) == 1, stderr[-3000:]
    others = [line for line in stderr.splitlines() if not line.startswith("cachemgr")]
    assert all(_LOG_EVENT.match(line) for line in others), others  # console log events only
    assert len(messages[0]) <= MESSAGE_LIMIT, len(messages[0])
    assert len(stderr) < 4 * MESSAGE_LIMIT, len(stderr)
    assert time.monotonic() - started < timeout
    return done.returncode, messages[0]


SERVER = ["--", "vllm", "serve", "org/model"]


@pytest.mark.parametrize("port", ["70000", "-1", "65536", "9" * 400, "0x50"])
def test_a_status_port_out_of_range_is_a_usage_error(env: dict[str, str], port: str) -> None:
    code, line = cli(["run", f"--status-port={port}", *SERVER], env)
    assert code == 64
    assert "--status-port" in line
    assert "0-65535" in line


@pytest.mark.parametrize(
    "flag", ["--lease-duration", "--wait-timeout", "--stall-timeout", "--lease-heartbeat"]
)
def test_a_duration_of_400_digits_is_a_usage_error(env: dict[str, str], flag: str) -> None:
    code, line = cli(["run", flag, "9" * 400, *SERVER], env)
    assert code == 64
    assert flag in line
    assert "too long" in line


def test_a_size_of_400_digits_is_a_usage_error(env: dict[str, str]) -> None:
    code, line = cli(["run", "--expected-size", "9" * 400, *SERVER], env)
    assert code == 64
    assert "too large" in line
    code, line = cli(["prune", "--keep-bytes", "9" * 400, "--dry-run"], env)
    assert code == 64


@pytest.mark.parametrize("model", ["m" * 100_000, "/" + "m" * 100_000, "org/" + "m" * 5000])
def test_a_100_kb_model_name_gets_a_short_message(env: dict[str, str], model: str) -> None:
    code, line = cli(["run", "--", "vllm", "serve", model], env)
    assert code == 78
    assert "characters" in line


@pytest.mark.parametrize("flag", ["--additional-config", "--compilation-config", "--speculative-config"])
def test_json_nested_900_deep_in_a_flag_is_a_config_error(env: dict[str, str], flag: str) -> None:
    deep = '{"a":' * 900 + "1" + "}" * 900
    code, line = cli(["key", "--", "vllm", "serve", "org/model", flag, deep], env)
    assert code == 78
    assert "nested" in line


def test_json_nested_900_deep_in_a_dotted_flag_is_a_config_error(env: dict[str, str]) -> None:
    deep = "[" * 900 + "]" * 900
    code, line = cli(["key", "--", "vllm", "serve", "org/model", "--additional-config.x", deep], env)
    assert code == 78
    assert "nested" in line


@pytest.mark.parametrize(
    "args",
    [
        [b"run", b"--role", b"pre\xfffill", *[w.encode() for w in SERVER]],
        [b"key", b"--", b"vllm", b"serve", b"org/\xed\xa0\x80model"],
        [b"ls", b"--cache-root", b"/vol\xfe"],
    ],
    ids=["flag", "server-argv", "inspection"],
)
def test_a_lone_surrogate_in_an_argument_is_a_usage_error(env: dict[str, str], args: list[bytes]) -> None:
    code, line = cli(list(args), env)
    assert code == 64
    assert "not valid UTF-8" in line


def test_a_lone_surrogate_in_a_keyed_environment_variable_is_a_usage_error(env: dict[str, str]) -> None:
    environ: dict[str | bytes, str | bytes] = {**env}
    environ[b"VLLM_RBLN_SOMETHING"] = b"\xff"
    code, line = cli(["key", *SERVER], environ)  # type: ignore[arg-type]
    assert code == 64
    assert "VLLM_RBLN_SOMETHING" in line


def _marker(env: dict[str, str]) -> Path:
    return Path(env["CACHEMGR_CACHE_ROOT"]) / "cachemgr-layout.json"


MARKERS = [
    '{"layout": 1e400}',
    '{"layout": -1e400}',
    '{"layout": NaN}',
    '{"layout": ' + "9" * 400 + "}",
    '{"layout": ' + "[" * 900 + "]" * 900 + "}",
    # No layout any cachemgr writes, not "a newer cachemgr" (the fuzzer, seed 7070 trial 124).
    '{"layout": 9223372036854775808}',
    '{"layout": 0}',
    '{"layout": true}',
]


@pytest.mark.parametrize(
    "text",
    MARKERS,
    ids=["inf", "-inf", "nan", "400-digits", "nested-900", "2**63", "zero", "bool"],
)
@pytest.mark.parametrize("command", ["run", "ls", "du", "prune"])
def test_a_marker_with_numbers_out_of_range_is_a_damaged_volume(
    env: dict[str, str], text: str, command: str
) -> None:
    _marker(env).write_text(text)
    args = {"run": ["run", *SERVER], "ls": ["ls"], "du": ["du"], "prune": ["prune", "--damaged", "--dry-run"]}
    code, line = cli(args[command], env)
    assert code == 74
    assert "cachemgr-layout.json is damaged" in line


def test_records_nested_900_deep_on_the_volume_are_damage_not_a_crash(env: dict[str, str]) -> None:
    """A use record, a lease holder and a staging owner written by anyone with the volume."""
    root = Path(env["CACHEMGR_CACHE_ROOT"])
    deep = "[" * 900 + "]" * 900
    digest = "0" * 32
    for folder in ("usage", "leases", "staging", f"usage/{digest}", f"staging/{digest}", "failures"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "cachemgr-layout.json").write_text(json.dumps({"layout": 1}))
    (root / "usage" / digest / "pod.json").write_text(deep)
    (root / "leases" / f"{digest}.holder.json").write_text(deep)
    (root / "staging" / digest / "pod.1.abcd").mkdir()
    (root / "staging" / digest / "pod.1.abcd.json").write_text(deep)
    for args in (["ls"], ["du"], ["locks"], ["prune", "--stale-staging", "--dry-run"]):
        done = subprocess.run(
            [sys.executable, "-m", "cachemgr", *args], env=env, capture_output=True, text=True,
            timeout=30, check=False,
        )  # fmt: skip
        assert "Traceback" not in done.stderr, (args, done.stderr[-2000:])
        assert done.returncode in {0, 74}, (args, done.stderr[-2000:])


def test_an_unwritable_state_dir_is_a_config_error(env: dict[str, str], tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    code, line = cli(["run", "--state-dir", str(blocker / "state"), *SERVER], env)
    assert code == 78
    assert "state dir" in line
    assert "emptyDir" in line


# --- vllm --config YAML --------------------------------------------------------------------------


def _laughs(levels: int) -> str:
    lines = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for level in range(1, levels):
        name, prev = chr(ord("a") + level), chr(ord("a") + level - 1)
        lines.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    return "\n".join([*lines, "max-model-len: 1024", ""])


def test_a_billion_laughs_config_is_refused_quickly(env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(_laughs(12))  # 9**12 strings once expanded
    code, line = cli(["key", "--", "vllm", "serve", "org/model", "--config", str(config)], env, timeout=15)
    assert code == 78
    assert "expands to more than" in line


def test_a_few_aliases_in_a_config_are_fine(env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text(_laughs(3))
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "key", "-o", "json", "--", "vllm", "serve", "org/model",
         "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert "Traceback" not in done.stderr
    # vLLM itself would refuse a, b, c (not its flags): the alias expansion was not the problem.
    assert done.returncode in {0, 78}, done.stderr
    assert "expands to more than" not in done.stderr


def test_a_config_nested_5000_deep_is_a_config_error(env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    config.write_text("compilation-config: " + "[" * 5000 + "]" * 5000 + "\n")
    code, _line = cli(["key", "--", "vllm", "serve", "org/model", "--config", str(config)], env)
    assert code == 78


def test_a_fifo_as_config_does_not_hang(env: dict[str, str], tmp_path: Path) -> None:
    fifo = tmp_path / "serve.yaml"
    os.mkfifo(fifo)  # no writer: a plain open() would wait for one forever
    code, line = cli(["key", "--", "vllm", "serve", "org/model", "--config", str(fifo)], env, timeout=15)
    assert code == 78
    assert "not a regular file" in line


def test_a_huge_config_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    config = tmp_path / "serve.yaml"
    with config.open("w") as out:
        out.write("max-model-len: 1024\n")
        out.write("# padding\n" * 200_000)
    code, line = cli(["key", "--", "vllm", "serve", "org/model", "--config", str(config)], env)
    assert code == 78
    assert "bytes" in line


def _model_dir(path: Path) -> Path:
    """A local model directory but for its config.json, which each test plants itself."""
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"w" * 100)
    return path


@pytest.mark.parametrize("command", ["key", "run"])
def test_a_fifo_as_the_models_config_json_does_not_hang(
    env: dict[str, str], tmp_path: Path, command: str
) -> None:
    """--model-impl auto reads the model's architectures from its config.json: a FIFO there with
    no writer hung key and run (and a pod blocked in open() ignores SIGTERM)."""
    model = _model_dir(tmp_path / "llm")
    os.mkfifo(model / "config.json")
    code, line = cli([command, "--", "vllm", "serve", str(model)], env, timeout=15)
    assert code == 78
    assert f"cannot read the model's config {model / 'config.json'}: it is a FIFO, not a regular file" in line


def test_a_huge_config_json_of_the_model_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    """Bounded, not read whole: a config.json is kilobytes, and one past 16 MiB is refused by name."""
    model = _model_dir(tmp_path / "llm")
    with (model / "config.json").open("w") as out:
        out.write('{"architectures": ["LlamaForCausalLM"], "padding": "' + "x" * (17 << 20) + '"}')
    code, line = cli(["key", "--", "vllm", "serve", str(model)], env)
    assert code == 78
    assert "config.json: larger than 16 MiB, not read" in line


def test_a_fifo_as_the_model_redirect_file_does_not_hang(env: dict[str, str], tmp_path: Path) -> None:
    """VLLM_MODEL_REDIRECT_PATH is read before anything else: a FIFO there hung key and run."""
    fifo = tmp_path / "redirect"
    os.mkfifo(fifo)
    code, line = cli(["key", *SERVER], {**env, "VLLM_MODEL_REDIRECT_PATH": str(fifo)}, timeout=15)
    assert code == 78
    assert f"cannot read VLLM_MODEL_REDIRECT_PATH {fifo}: it is a FIFO, not a regular file" in line
    assert "unset VLLM_MODEL_REDIRECT_PATH" in line


def test_a_huge_model_redirect_file_is_refused(env: dict[str, str], tmp_path: Path) -> None:
    table = tmp_path / "redirect"
    table.write_text("org/other /models/other\n" * 100_000)  # 2.4 MB: read whole before
    code, line = cli(["key", *SERVER], {**env, "VLLM_MODEL_REDIRECT_PATH": str(table)})
    assert code == 78
    assert "larger than 1 MiB, not read" in line


@pytest.mark.parametrize(
    "text",
    ['{"phase": "serving", "since": 1, "started_at": 1, "pid": 1e400}', "[" * 5000 + "]" * 5000],
    ids=["pid-inf", "nested-5000"],
)
def test_a_probe_reading_a_damaged_state_record_fails_with_its_one_line(
    env: dict[str, str], tmp_path: Path, text: str
) -> None:
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "state.json").write_text(text)
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "probe", "live", "--state-dir", str(state_dir)],
        env=env, capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("live failed: cannot read")


@pytest.mark.parametrize("kind", ["work", "volume", "file"])
def test_demo_never_removes_a_dir_it_did_not_make(env: dict[str, str], tmp_path: Path, kind: str) -> None:
    """``cachemgr demo --dir .`` (or $HOME, or a cache volume) used to remove that directory whole
    before it started; now only a directory the demo made is removed, and the rest is refused."""
    target = tmp_path / "target"
    if kind == "file":
        target.write_text("an operator's file\n")
        kept = {target: target.read_bytes()}
    else:
        target.mkdir()
        names = ["notes.txt"] if kind == "work" else ["cachemgr-layout.json", "CACHEDIR.TAG"]
        kept = {target / name: f"{name}\n".encode() for name in names}
        for path, data in kept.items():
            path.write_bytes(data)
        (target / "entries").mkdir()
    code, message = cli(["demo", "--dir", str(target), "--compile-seconds", "0.1"], env)
    assert code == 64, message
    assert message.startswith(f"cachemgr demo: --dir {target} is not a directory this demo made"), message
    assert "nothing was removed" in message
    assert "cachemgr demo --dir /tmp/cachemgr-demo" in message
    assert {path: path.read_bytes() for path in kept} == kept


def test_demo_reuses_its_own_dir_and_an_empty_one(tmp_path: Path) -> None:
    from cachemgr.cli import demo

    empty = tmp_path / "empty"
    empty.mkdir()
    demo.prepare(empty)
    assert (empty / demo.MARKER).is_file()
    (empty / "prefill-volume" / "leftover").write_text("from the last run\n")
    demo.prepare(empty)  # its own: removed and made again
    assert not (empty / "prefill-volume" / "leftover").exists()
    older = tmp_path / "older"  # made by a demo before the marker: only the demo's own names
    for name in ("bin", "prefill-volume", "decode-volume", "pods", "logs"):
        (older / name).mkdir(parents=True)
    (older / "standin-record.jsonl").write_text("")
    demo.prepare(older)
    assert (older / demo.MARKER).is_file()


def test_a_role_other_than_prefill_or_decode_is_keyed_as_written_as_the_reference_says(
    env: dict[str, str],
) -> None:
    """The reference said ``prefill`` or ``decode``; any lowercase name is keyed (cachemgr.key):
    the doc now says so, and that a misspelt role compiles entries of its own."""
    keyed = subprocess.run(
        [sys.executable, "-m", "cachemgr", "key", "--role", "prefil", "-o", "json", *SERVER],
        env=env, capture_output=True, text=True, timeout=20, check=False,
    )  # fmt: skip
    assert keyed.returncode == 0, keyed.stderr
    assert json.loads(keyed.stdout)["inputs"]["role"] == "prefil"
    reference = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    (row,) = [line for line in reference.splitlines() if line.startswith("| `CACHEMGR_ROLE`")]
    assert "keyed as written" in row
    assert "a misspelt role (`prefil`) compiles entries of its own" in row


# What each inspection command needs to get as far as the volume (its own arguments).
_TO_THE_VOLUME = {"show": ["abc"], "explain": SERVER, "prune": ["--incompatible", "--yes"]}


def test_each_command_of_the_references_table_documents_its_exit_where_no_volume_is_mounted(
    env: dict[str, str], tmp_path: Path
) -> None:
    """Issue 40: the reference's table of commands omitted 74 for du, locks, stats, show and prune,
    which all exit 74 when the volume is not mounted. Each command of the table, run where no
    volume is, exits with a code its row documents for the volume."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "reference.md").read_text()
    rows = re.findall(r"^\| `cachemgr (\w+)[^`]*` \| [^|]+ \| (.+) \|$", text, flags=re.MULTILINE)
    commands = [command for command, _ in rows]
    assert set(commands) >= {"ls", "show", "explain", "du", "verify", "prune", "locks", "stats"}, commands
    env = {**env, "CACHEMGR_CACHE_ROOT": str(tmp_path / "not-mounted")}
    for command, codes in rows:
        code, line = cli([command, *_TO_THE_VOLUME.get(command, [])], env)
        assert code == 74, (command, code, line)
        assert "does not exist. Mount the compile cache PVC there" in line, line
        assert re.search(rf"\b{code}\b[^;]*volume", codes), (
            f"cachemgr {command} exits {code} unmounted; its row: {codes}"
        )


@pytest.mark.parametrize("value", ["post-upgrade", "pre-upgrade\n", "\x1b[31mred", "x" * 5000])
def test_a_warm_hook_variable_no_chart_sets_is_a_configuration_error(env: dict[str, str], value: str) -> None:
    """CACHEMGR_WARM_HOOK is the chart's (pre-upgrade on a hook Job): anything else is exit 78, one
    escaped line; a serving pod's run does not read it."""
    code, line = cli(["warm", *SERVER], {**env, "CACHEMGR_WARM_HOOK": value})
    assert code == 78, line
    assert "CACHEMGR_WARM_HOOK" in line
    assert "\x1b" not in line
    assert len(line) < 400, line
