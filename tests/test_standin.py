"""Real-process tests of the stand-in compiler and server (cachemgr_standin, not the real tools).

Every wait polls a file, a process or an HTTP port against a deadline; no test sleeps and hopes.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from cachemgr_standin.compiler import load_compiled_dir
from cachemgr_standin.shim import write_vllm_shim
from cachemgr_testkit.podlib import free_port

DEADLINE = 20.0
SERVER = [sys.executable, "-m", "cachemgr_standin.server"]
COMPILER = [sys.executable, "-m", "cachemgr_standin.compiler"]
# Straight to 127.0.0.1, whatever http_proxy the environment has.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Proc:
    """A child process with stdout/stderr in files, so nothing blocks on a full pipe."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, name: str) -> None:
        self.out_path = cwd / f"{name}.out"
        self.err_path = cwd / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.popen = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=err)
        self.pid = self.popen.pid

    def stdout(self) -> str:
        return self.out_path.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def wait(self, timeout: float = DEADLINE) -> int:
        return self.popen.wait(timeout=timeout)

    def send(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=DEADLINE)


Spawn = Callable[..., Proc]


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """A clean environment: no inherited STANDIN_/VLLM_ knobs, everything under tmp_path."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("STANDIN_", "VLLM_", "LOCAL_RANK"))}
    (tmp_path / "tmp").mkdir()
    base.update(
        VLLM_CACHE_ROOT=str(tmp_path / "cache"),
        TMPDIR=str(tmp_path / "tmp"),
        STANDIN_COMPILE_SECONDS="0.2",
        STANDIN_LOAD_SECONDS="0",
        STANDIN_ARTIFACT_FILES="4",
        STANDIN_ARTIFACT_BYTES="64k",
        STANDIN_RECORD=str(tmp_path / "record.jsonl"),
        STANDIN_SIGNAL_LOG=str(tmp_path / "signals.log"),
    )
    return base


@pytest.fixture
def spawn(tmp_path: Path, env: dict[str, str]) -> Iterator[Spawn]:
    procs: list[Proc] = []

    def start(argv: list[str], *, name: str = "proc", **overrides: str) -> Proc:
        proc = Proc(argv, {**env, **overrides}, tmp_path, f"{name}{len(procs)}")
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.stop()


def http_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes] | None:
    """(status, body), or None while nothing listens."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=headers or {})
    try:
        with _OPENER.open(request, timeout=2) as response:
            return int(response.status), response.read()
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, exc.read()
        finally:
            exc.close()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def wait_until(
    check: Callable[[], bool], what: str, proc: Proc | None = None, deadline: float = DEADLINE
) -> None:
    end = time.monotonic() + deadline
    while not check():
        if proc is not None and proc.popen.poll() is not None:
            pytest.fail(
                f"exited {proc.popen.returncode} while waiting for {what}:\n{proc.stdout()}\n{proc.stderr()}"
            )
        if time.monotonic() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.02)


def wait_healthy(proc: Proc, port: int) -> None:
    wait_until(lambda: http_get(port, "/health") == (200, b""), f"/health on {port}", proc)


def wait_output(proc: Proc, text: str) -> None:
    wait_until(lambda: text in proc.stdout(), f"{text!r} on stdout", proc)


def artifacts(port: int) -> dict[str, Any]:
    reply = http_get(port, "/standin/artifacts")
    assert reply is not None
    assert reply[0] == 200
    result: dict[str, Any] = json.loads(reply[1])
    return result


def records(tmp_path: Path, pid: int | None = None) -> list[dict[str, Any]]:
    path = tmp_path / "record.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    events = [json.loads(line) for line in lines]
    return [e for e in events if pid is None or e["pid"] == pid]


def events(tmp_path: Path, pid: int) -> list[str]:
    return [e["event"] for e in records(tmp_path, pid)]


def serve(spawn: Spawn, model: str, *flags: str, **env: str) -> tuple[Proc, int]:
    port = free_port()
    return spawn([*SERVER, "serve", model, "--port", str(port), *flags], name="server", **env), port


def stop(proc: Proc, signum: int = signal.SIGTERM) -> int:
    proc.send(signum)
    return proc.wait()


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# --- compiler ---------------------------------------------------------------


def test_compiler_output_loads_with_identical_digest(tmp_path: Path, spawn: Spawn) -> None:
    record = tmp_path / "compiler.jsonl"
    out = tmp_path / "compiled"
    flags = ["--model", "org/m", "--files", "3", "--bytes", "10000", "--seconds", "0.05"]
    extra = ["--record", str(record), "--max-seq-len", "4096"]
    compiler = spawn([*COMPILER, "--output-dir", str(out), *flags, *extra], name="compiler")
    assert compiler.wait() == 0, compiler.stderr()
    assert compiler.stderr().startswith("STAND-IN RBLN compiler (cachemgr_standin, not rebel-compiler)")
    assert "[standin] compiling graph 3/3" in compiler.stdout()
    rbln = sorted(p.relative_to(out).as_posix() for p in out.rglob("*.rbln"))
    assert rbln == ["graph_000.rbln", "graph_001.rbln", "submodule/graph_002.rbln"]
    assert sum((out / name).stat().st_size for name in rbln) == 10000
    started, finished = (json.loads(line) for line in record.read_text().splitlines())
    assert started["event"] == "compile"
    assert started["argv"][-2:] == ["--max-seq-len", "4096"]
    assert finished["event"] == "compiled"

    server, port = serve(spawn, str(out))
    wait_healthy(server, port)
    assert artifacts(port)["digest"] == finished["digest"]
    assert events(tmp_path, server.pid) == ["load"]
    assert records(tmp_path, server.pid)[0]["digest"] == finished["digest"]
    assert stop(server) == 0


def test_compiler_is_deterministic_and_keys_on_extra_args(tmp_path: Path, spawn: Spawn) -> None:
    def compile_to(name: str, *extra: str) -> str:
        out = tmp_path / name
        proc = spawn([*COMPILER, "--output-dir", str(out), "--seconds", "0", "--bytes", "20k", *extra])
        assert proc.wait() == 0, proc.stderr()
        return load_compiled_dir(out)[0]

    first = compile_to("a", "--opt", "1")
    assert compile_to("b", "--opt", "1") == first
    assert (tmp_path / "a" / "graph_001.rbln").read_bytes() == (
        tmp_path / "b" / "graph_001.rbln"
    ).read_bytes()
    assert compile_to("c", "--opt", "2") != first


@pytest.mark.parametrize(
    ("flags", "code", "message"),
    [
        (["--fail-with", "5"], 5, "stand-in fault --fail-with=5"),
        (["--quota-exceeded"], 1, "OSError: [Errno 122] Disk quota exceeded: '"),
    ],
)
def test_compiler_faults_leave_no_compiled_dir(
    spawn: Spawn, tmp_path: Path, flags: list[str], code: int, message: str
) -> None:
    out = tmp_path / "compiled"
    proc = spawn([*COMPILER, "--output-dir", str(out), "--seconds", "0", *flags])
    assert proc.wait() == code
    assert message in last_line(proc.stderr())
    assert list(out.rglob("*.rbln")), "faults fire after some files are written"
    assert not (out / "rbln_config.json").exists()


# --- server: caching ----------------------------------------------------------


def test_vllm_path_compiles_then_hits_and_saves_again(tmp_path: Path, spawn: Spawn) -> None:
    first, port = serve(spawn, "org/model", VLLM_RBLN_USE_VLLM_MODEL="1")
    wait_healthy(first, port)
    assert first.stderr().startswith("STAND-IN vllm server (cachemgr_standin, not vLLM): ")
    assert events(tmp_path, first.pid) == ["compile", "compiled", "save"]
    bundles = list((tmp_path / "cache" / "rbln").glob("org_model-*/*/rank0/mega_cache.bin"))
    assert len(bundles) == 1
    saved = records(tmp_path, first.pid)[-1]
    assert saved["path"] == str(bundles[0])
    assert artifacts(port)["digest"] == saved["digest"]
    inode = bundles[0].stat().st_ino
    assert stop(first) == 0

    second, port = serve(spawn, "org/model", VLLM_RBLN_USE_VLLM_MODEL="1")
    wait_healthy(second, port)
    assert events(tmp_path, second.pid) == ["load", "save"], "a hit compiles nothing but saves again"
    assert {e["digest"] for e in records(tmp_path, second.pid)} == {saved["digest"]}
    assert bundles[0].stat().st_ino != inode, "saved through a fresh file and a rename"
    assert "compiling graph" not in second.stdout()
    assert stop(second) == 0


def test_vllm_path_recompiles_an_unreadable_bundle(tmp_path: Path, spawn: Spawn) -> None:
    first, port = serve(spawn, "m", VLLM_RBLN_USE_VLLM_MODEL="1")
    wait_healthy(first, port)
    assert stop(first) == 0
    bundle = Path(records(tmp_path, first.pid)[-1]["path"])
    bundle.write_bytes(bundle.read_bytes()[:-10])  # torn

    second, port = serve(spawn, "m", VLLM_RBLN_USE_VLLM_MODEL="1")
    wait_healthy(second, port)
    assert "Ignored an unreadable rbln mega-cache bundle" in second.stdout()
    assert events(tmp_path, second.pid) == ["compile", "compiled", "save"]
    assert stop(second) == 0


def test_vllm_path_keeps_one_bundle_per_rank(tmp_path: Path, spawn: Spawn) -> None:
    proc, port = serve(spawn, "m", "-tp", "2", VLLM_RBLN_USE_VLLM_MODEL="1")
    wait_healthy(proc, port)
    ranks = sorted(p.parent.name for p in (tmp_path / "cache").rglob("mega_cache.bin"))
    assert ranks == ["rank0", "rank1"]
    assert stop(proc) == 0


def test_optimum_path_keys_on_compile_flags_only(tmp_path: Path, spawn: Spawn) -> None:
    compiled = tmp_path / "cache" / "compiled_models"
    first, port = serve(spawn, "org/m:v1", "--max-model-len", "1024", "--api-key", "k1")
    wait_healthy(first, port)
    assert events(tmp_path, first.pid) == ["compile", "compiled", "save"]
    assert [p.name for p in compiled.iterdir()] == [f"org_m_v1_{artifacts(port)['signature']}"]
    assert stop(first) == 0

    # Same config spelled differently, other runtime flags: a hit.
    same, port = serve(spawn, "org/m:v1", "--host", "127.0.0.1", "--max_model_len=1024", "--api-key", "k2")
    wait_healthy(same, port)
    assert events(tmp_path, same.pid) == ["load"]
    assert stop(same) == 0

    other, port = serve(spawn, "org/m:v1", "--max-model-len", "2048")
    wait_healthy(other, port)
    assert events(tmp_path, other.pid) == ["compile", "compiled", "save"]
    assert len(list(compiled.iterdir())) == 2
    assert stop(other) == 0


def test_precompiled_dir_with_a_missing_file_fails(tmp_path: Path, spawn: Spawn) -> None:
    out = tmp_path / "compiled"
    compiler = spawn([*COMPILER, "--output-dir", str(out), "--seconds", "0"])
    assert compiler.wait() == 0
    (out / "submodule" / "graph_003.rbln").unlink()
    server, _ = serve(spawn, str(out))
    assert server.wait() == 1
    # optimum-rbln's _load_compiled_models: every graph rbln_config.json names (modeling_base.py 205-211)
    assert "Expected RBLN compiled model 'graph_003.rbln' not found" in server.stderr()


def test_http_endpoints(spawn: Spawn) -> None:
    proc, port = serve(spawn, "org/m", "--served-model-name", "a", "b", "--api-key", "secret")
    wait_healthy(proc, port)
    assert http_get(port, "/v1/models") == (401, b'{"error": "Unauthorized"}')
    reply = http_get(port, "/v1/models", {"Authorization": "Bearer secret"})
    assert reply is not None
    assert [m["id"] for m in json.loads(reply[1])["data"]] == ["a", "b"]
    assert http_get(port, "/nope") == (404, b'{"detail": "Not Found"}')
    assert stop(proc, signal.SIGINT) == 0


def test_shim_runs_the_literal_vllm_argv(tmp_path: Path, spawn: Spawn, env: dict[str, str]) -> None:
    bin_dir = tmp_path / "bin"
    shim = write_vllm_shim(bin_dir)
    assert shim == bin_dir / "vllm"
    assert os.access(shim, os.X_OK)
    path = f"{bin_dir}{os.pathsep}{env['PATH']}"
    assert shutil.which("vllm", path=path) == str(shim)
    port = free_port()
    proc = spawn(["vllm", "serve", "org/m", "--port", str(port)], PATH=path)
    wait_healthy(proc, port)
    assert "STAND-IN vllm server" in proc.stderr()
    assert stop(proc) == 0


# --- server: signals and faults ---------------------------------------------


def test_signals_while_serving(tmp_path: Path, spawn: Spawn) -> None:
    proc, port = serve(spawn, "m")
    wait_healthy(proc, port)
    proc.send(signal.SIGHUP)
    wait_until((tmp_path / "signals.log").exists, "the SIGHUP line")
    wait_healthy(proc, port)  # still serving
    assert stop(proc) == 0
    assert (tmp_path / "signals.log").read_text().splitlines() == ["SIGHUP", "SIGTERM"]


def test_sigterm_while_compiling_exits_promptly_and_cleans_up(tmp_path: Path, spawn: Spawn) -> None:
    proc, port = serve(spawn, "m", STANDIN_COMPILE_SECONDS="60")
    wait_output(proc, "compiling graph 1/4")
    proc.send(signal.SIGTERM)
    assert proc.wait(timeout=5) == 0
    assert http_get(port, "/health") is None
    assert not list((tmp_path / "tmp").iterdir()), "the compile's temporary directory is removed"
    assert not (tmp_path / "cache" / "compiled_models").exists()


@pytest.mark.parametrize("compiling", [True, False])
def test_sigquit_kills_by_sigquit(tmp_path: Path, spawn: Spawn, compiling: bool) -> None:
    proc, port = serve(spawn, "m", STANDIN_COMPILE_SECONDS="60" if compiling else "0")
    if compiling:
        wait_output(proc, "compiling graph 1/4")
    else:
        wait_healthy(proc, port)
    assert stop(proc, signal.SIGQUIT) == -signal.SIGQUIT
    assert (tmp_path / "signals.log").read_text() == "SIGQUIT\n"
    assert not list(tmp_path.glob("core*"))


def test_exit_code_knob_applies_to_sigterm(spawn: Spawn) -> None:
    proc, port = serve(spawn, "m", STANDIN_EXIT_CODE="7")
    wait_healthy(proc, port)
    assert stop(proc) == 7


@pytest.mark.parametrize("impl", ["optimum", "vllm"])
def test_quota_knob(tmp_path: Path, spawn: Spawn, impl: str) -> None:
    proc, _ = serve(spawn, "m", STANDIN_QUOTA_EXCEEDED="1", VLLM_RBLN_USE_VLLM_MODEL=str(int(impl == "vllm")))
    assert proc.wait() == 1
    assert last_line(proc.stderr()).startswith(
        f"OSError: [Errno 122] Disk quota exceeded: '{tmp_path / 'cache'}"
    )
    assert "compiling graph 2/4" in proc.stdout()
    assert events(tmp_path, proc.pid) == ["compile"]
    assert not list((tmp_path / "cache").rglob("rbln_config.json"))
    assert not list((tmp_path / "cache").rglob("mega_cache.bin"))


@pytest.mark.parametrize(("knob", "code"), [("3", 3), ("-9", -9)])
def test_exit_before_healthy(tmp_path: Path, spawn: Spawn, knob: str, code: int) -> None:
    proc, port = serve(spawn, "m", STANDIN_EXIT_BEFORE_HEALTHY=knob)
    assert proc.wait() == code
    assert http_get(port, "/health") is None
    assert "compiling graph 2/4" in proc.stdout()
    assert "compiling graph 3/4" not in proc.stdout()


def test_start_record_says_who_forked_the_server_and_when(tmp_path: Path, spawn: Spawn) -> None:
    starts = tmp_path / "starts.jsonl"
    before = time.clock_gettime(time.CLOCK_BOOTTIME)
    proc, port = serve(spawn, "m", STANDIN_START_RECORD=str(starts))
    wait_healthy(proc, port)
    (start,) = [json.loads(line) for line in starts.read_text().splitlines()]
    assert (start["event"], start["pid"], start["ppid"]) == ("start", proc.pid, os.getpid())
    # /proc's start time is to the clock tick, truncated: at most one tick before the spawn.
    assert before - 0.01 <= start["spawned_boot"] <= time.clock_gettime(time.CLOCK_BOOTTIME)
    assert stop(proc) == 0


def test_hang_knob_goes_silent_and_idle(tmp_path: Path, spawn: Spawn) -> None:
    proc, port = serve(spawn, "m", STANDIN_HANG="1")
    wait_output(proc, "compiling graph 2/4")
    process = psutil.Process(proc.pid)
    before, output = sum(process.cpu_times()[:2]), proc.stdout()
    time.sleep(0.5)  # a measurement window, not a wait
    assert sum(process.cpu_times()[:2]) - before < 0.05
    assert proc.stdout() == output
    assert http_get(port, "/health") is None
    assert stop(proc) == 0


# --- real ENOSPC ----------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs: real ENOSPC, not a knob."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)], check=False)
    if done.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.tmpfs
def test_enospc_on_the_optimum_path_fails_the_server(tmp_path: Path, spawn: Spawn, small_fs: Path) -> None:
    proc, _ = serve(spawn, "m", VLLM_CACHE_ROOT=str(small_fs), STANDIN_ARTIFACT_BYTES="1M")
    assert proc.wait() == 1
    assert "No space left on device" in last_line(proc.stderr())
    assert "save" not in events(tmp_path, proc.pid)
    assert list((small_fs / "compiled_models").iterdir()) == [], "save_pretrained removes its .tmp copy"


@pytest.mark.tmpfs
def test_enospc_on_the_vllm_path_is_logged_and_serving_goes_on(
    tmp_path: Path, spawn: Spawn, small_fs: Path
) -> None:
    proc, port = serve(
        spawn, "m", VLLM_CACHE_ROOT=str(small_fs), STANDIN_ARTIFACT_BYTES="1M", VLLM_RBLN_USE_VLLM_MODEL="1"
    )
    wait_healthy(proc, port)
    assert "(out of disk space)" in proc.stdout()
    assert events(tmp_path, proc.pid) == ["compile", "compiled", "save-failed"]
    assert not list(small_fs.rglob("mega_cache.bin*")), "the tmp file is removed"
    assert stop(proc) == 0


@pytest.mark.tmpfs
def test_enospc_fails_the_compiler(spawn: Spawn, small_fs: Path) -> None:
    proc = spawn([*COMPILER, "--output-dir", str(small_fs / "out"), "--seconds", "0", "--bytes", "1M"])
    assert proc.wait() == 1
    assert last_line(proc.stderr()).startswith("OSError: [Errno 28] No space left on device")


# --- honest to vllm-rbln 0.12 on what the key rests on (issue 13; tools/rbln_facts.py) ---------


def _signature(spawn: Spawn, *flags: str, **env: str) -> str:
    proc, port = serve(spawn, "m", "--model-impl", "vllm", *flags, **env)
    wait_healthy(proc, port)
    signature = str(artifacts(port)["signature"])
    assert stop(proc) == 0
    return signature


def test_vllm_path_signature_hashes_the_vllm_version_and_the_raw_npu_name(spawn: Spawn) -> None:
    base = _signature(spawn)
    assert _signature(spawn, STANDIN_VLLM_VERSION="0.30.1") != base, "vllm.__version__ is in compute_hash()"
    # The device answers first; the settings only without one (platform/__init__.py 136-151).
    assert _signature(spawn, RBLN_FORCE_NPU_NAME="RBLN-CA12") == base
    assert _signature(spawn, STANDIN_NPU_NAME="none", RBLN_FORCE_NPU_NAME="RBLN-CA25") == base
    assert _signature(spawn, STANDIN_NPU_NAME="none", RBLN_FORCE_NPU_NAME="rbln-ca25") != base, "hashed raw"
    assert _signature(spawn, STANDIN_NPU_NAME="none", RBLN_TARGET_SOC="RBLN-CA25") == base
    assert _signature(spawn, STANDIN_NPU_NAME="RBLN-CA12") != base


@pytest.mark.parametrize(
    ("flags", "env"), [(("--enforce-eager",), {}), ((), {"VLLM_RBLN_ENABLE_WARM_UP": "0"})]
)
def test_vllm_path_without_warm_up_compiles_and_saves_nothing(
    tmp_path: Path, spawn: Spawn, flags: tuple[str, ...], env: dict[str, str]
) -> None:
    proc, port = serve(spawn, "m", "--model-impl", "vllm", *flags, **env)
    wait_healthy(proc, port)
    assert "Skipping compile_or_warm_up_model" in proc.stdout()
    assert events(tmp_path, proc.pid) == []
    assert not list((tmp_path / "cache").rglob("mega_cache.bin"))
    assert stop(proc) == 0


def test_optimum_path_compiles_in_tmpdir_and_needs_a_device(tmp_path: Path, spawn: Spawn) -> None:
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    proc, port = serve(spawn, "m", TMPDIR=str(tmp))
    wait_healthy(proc, port)
    (compiled,) = [e for e in records(tmp_path, proc.pid) if e["event"] == "compiled"]
    assert Path(compiled["path"]).parent == tmp, "optimum-rbln compiles into a TemporaryDirectory()"
    assert stop(proc) == 0
    cpu, _port = serve(spawn, "other", STANDIN_NPU_NAME="none", VLLM_RBLN_COMPILE_ONLY="1")
    assert cpu.wait() == 1
    assert "not a valid NPU device" in cpu.stderr()


@pytest.mark.parametrize("module", ["rebel.core.mega_cache", "rebel.core.torch_compile", "rebel._runtime"])
def test_the_strict_npu_runtime_names_what_its_own_modules_lack(tmp_path: Path, module: str) -> None:
    """A name the real code reads from one of the stand-in's own modules (vllm-rbln 0.11.2 called
    ``rebel.core.mega_cache.flush_to_bundle``) fails loudly and is a ``missing`` event, as the
    surface's placeholders are: the real code swallowed the AttributeError (mega_cache.py:239)."""
    events = tmp_path / "events.jsonl"
    code = f"import importlib\nimportlib.import_module({module!r}).not_in_the_stand_in()\n"
    pymods = Path(__file__).resolve().parent.parent / "standin" / "cachemgr_standin" / "pymods"
    env = {
        **os.environ,
        "PYTHONPATH": str(pymods),
        "STANDIN_REBEL_STRICT": "1",
        "STANDIN_REBEL_EVENTS": str(events),
    }
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=False
    )
    assert "NotImplementedError" in done.stderr, done.stderr
    assert f"{module}.not_in_the_stand_in" in done.stderr
    missing = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["name"] for e in missing if e["event"] == "missing"] == [f"{module}.not_in_the_stand_in(...)"]
