"""A compiler's output is bounded where cachemgr keeps it, and passed on whole (issue 26 item 5).

Real pods with the stand-in compiler printing a 60 MB line without a newline, or drawing a ``\\r``
progress bar; real failure records on the volume, planted ones too (anyone who can write the
volume can write one of any size); ``du`` and ``prune --failures`` on them.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import Cluster, Pod, free_port, run_cli, wait_for
from cachemgr_testkit.scenarios import compile_cmd, server_argv

from cachemgr.runtime.launcher import DISK_FULL_PHRASES
from cachemgr.runtime.output import LINE_BYTES, LineKeeper, Tail
from cachemgr.volume.failure_records import RECORD_BYTES, RECORDS_PER_KEY, record_failure
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root

MiB = 1 << 20
# cachemgr's own peak RSS while it passes 60 MB of one line through: what it needs anyway (about
# 30 MB: the interpreter and its imports) and room, far below the line (readline held 200 MB).
RSS_BOUND_KIB = 80 * 1024


def _command(record: Path, extra: str, *, seconds: float = 3.0) -> list[str]:
    return ["--strategy", "command", "--compile-cmd", compile_cmd(record, seconds=seconds, extra=extra)]


def _peak_rss_kib(pid: int) -> int:
    """VmHWM: the process's peak resident set so far (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    line = next((x for x in status.splitlines() if x.startswith("VmHWM:")), "VmHWM: 0 kB")
    return int(line.split()[1])


def _wait_exit_sampling_peak(pod: Pod, *, timeout: float = 60.0) -> tuple[int, int]:
    """Wait for the pod to exit, reading its peak RSS meanwhile (VmHWM only grows: the last read
    before the exit is the peak up to then; the compile runs on for seconds after the long line)."""
    peak = 0

    def exited() -> bool:
        nonlocal peak
        peak = max(peak, _peak_rss_kib(pod.proc.pid))
        return pod.proc.poll() is not None

    wait_for(exited, timeout=timeout, what=f"{pod.name} to exit", every=0.05)
    return pod.proc.returncode, peak


def _records(root: Path) -> list[Path]:
    return sorted((root / "failures").rglob("*.json")) if (root / "failures").is_dir() else []


# --- the pump --------------------------------------------------------------------------------


def test_a_60_mb_line_without_a_newline_keeps_cachemgr_small_reaches_the_log_and_is_cut_in_the_record(
    pods: Cluster, root: Path
) -> None:
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "a",
        server_argv(free_port()),
        cache_root=root,
        options=_command(record, "--long-line 60M --fail-with 3"),
    )
    code, peak = _wait_exit_sampling_peak(pod)
    assert code == 70, pod.tail()
    assert 0 < peak < RSS_BOUND_KIB, f"cachemgr peaked at {peak} KiB passing a 60 MB line through"
    assert pod.log.stat().st_size > 60 * MiB, "every byte of the compiler's output reaches the pod's log"
    (path,) = _records(root)
    assert path.stat().st_size <= RECORD_BYTES
    kept = json.loads(path.read_text())
    long = [line for line in kept["output_tail"] if line.startswith("0.0000, ")]
    assert len(long) == 1
    assert len(long[0].encode()) < LINE_BYTES + 64, "the long line is kept, cut"
    assert long[0].endswith("bytes cut]")
    assert any("stand-in fault --fail-with=3" in line for line in kept["output_tail"])


def test_a_carriage_return_progress_bar_reaches_the_log_as_it_is_drawn(pods: Cluster, root: Path) -> None:
    """The bar never ends its line while compiling (it hangs halfway): each frame must be passed on
    as it arrives, not held until a newline that does not come."""
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "a",
        server_argv(free_port()),
        cache_root=root,
        options=_command(record, "--progress-bar --hang", seconds=0.6),
    )
    frame = b"\r[standin] compiling graph 3/6"  # the fault point of 6 graphs: the bar stops there
    wait_for(lambda: frame in pod.log.read_bytes(), timeout=30, what="the bar's third frame in the pod's log")
    assert pod.proc.poll() is None, "the compiler still runs: the frame was not flushed by its exit"
    pod.signal(signal.SIGTERM)
    assert pod.wait_exit() == 143


@pytest.mark.parametrize("phrase", ["No space left on device", "OSError: [Errno 122] Disk quota exceeded"])
def test_a_disk_full_phrase_is_seen_whatever_read_splits_it_and_past_a_long_lines_cut(phrase: str) -> None:
    data = b"x" * (LINE_BYTES + 100) + b" " + phrase.encode() + b": '/cache/staging/a'\nnext line\n"
    at = data.index(phrase.encode())
    for split in range(at - 2, at + len(phrase) + 2):
        tail = Tail()
        keeper = LineKeeper(tail, DISK_FULL_PHRASES)
        seen = [keeper.feed(data[:split]), keeper.feed(data[split:])]
        keeper.close()
        assert seen.count(True) == 1, f"split at {split - at} of the phrase"
        shown = keeper.disk_full_text()
        assert shown is not None
        assert phrase in shown, shown
        assert len(shown) < 400
        assert [len(line.encode()) <= LINE_BYTES + 40 for line in tail.lines] == [True, True]


def test_kept_lines_follow_a_terminal_a_carriage_return_starts_the_line_over() -> None:
    tail = Tail()
    keeper = LineKeeper(tail, DISK_FULL_PHRASES)
    for piece in (b"loading\r 10%", b"\r 50%\r", b"\n", b"done\r", b"\nlast\r 99%"):
        keeper.feed(piece)
    keeper.close()
    assert list(tail.lines) == [" 50%", "done", " 99%"]
    assert tail.bytes == sum(map(len, (b"loading\r 10%", b"\r 50%\r", b"\n", b"done\r", b"\nlast\r 99%")))


def _feed(keeper: LineKeeper, data: bytes, least: int, most: int, rng: random.Random) -> None:
    """``data`` to ``keeper`` in reads of ``least`` to ``most`` bytes, as pipes split it."""
    at = 0
    while at < len(data):
        size = rng.randint(least, most)
        keeper.feed(data[at : at + size])
        at += size


def test_kept_lines_do_not_depend_on_how_reads_split_the_output() -> None:
    """Fed a byte at a time or in chunks of any size (where the lines a tail cannot show are only
    counted), the tail, the line count and the byte count are the same."""
    rng = random.Random(26)
    for _ in range(300):
        data = bytes(rng.choice(b"ab\r\n\n  x") for _ in range(rng.randint(0, 3000)))
        one, chunked = Tail(lines=5), Tail(lines=5)
        by_byte, by_chunk = (
            LineKeeper(one, DISK_FULL_PHRASES, line_bytes=7),
            LineKeeper(chunked, DISK_FULL_PHRASES, line_bytes=7),
        )
        _feed(by_byte, data, 1, 1, rng)
        _feed(by_chunk, data, 1, 400, rng)
        by_byte.close()
        by_chunk.close()
        assert (list(one.lines), one.count, one.bytes) == (list(chunked.lines), chunked.count, chunked.bytes)


def _vllm_failing_to_load() -> bytes:
    """How the real vLLM 0.30 (vllm-rbln 0.12) dies on a model whose safetensors do not parse: its
    engine logs the traceback (each line prefixed by process and log header), prints it again raw,
    then its API server prints tens of lines of its own ending in a RuntimeError (pod log of
    tests/test_realserver.py, trimmed; \r\n as some of its lines end)."""
    engine, logged = "(EngineCore pid=4169) ", "(EngineCore pid=4169) ERROR 12-06 06:38:23 [core.py:1366] "
    api = "(APIServer pid=2950) "
    root_cause = "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: invalid header length"
    frames = [
        f'  File "/venv/lib/python3.11/site-packages/vllm/m{i}.py", line {i}, in f{i}\n    call({i})'
        for i in range(30)
    ]

    def traceback(prefix: str, last: str, eol: str = "\n") -> str:
        body = ["Traceback (most recent call last):", *"\n".join(frames).splitlines(), last]
        return "".join(f"{prefix}{line}{eol}" for line in body)

    return "".join(
        [
            f"{api}WARNING 12-06 06:37:24 [system_utils.py:299] fd limit errors like `OSError: [Errno 24] Too many open files`\n",
            f"{logged}EngineCore failed to start.\r\n",
            traceback(logged, root_cause, "\r\n"),
            f"{engine}Process EngineCore:\n",
            f"{api}INFO 12-06 06:38:27 [utils.py:632] [shutdown] Process manager: send sigterm\n",
            traceback(engine, root_cause),
            traceback(
                api,
                "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
            ),
        ]
    ).encode()


@pytest.mark.quick
def test_what_a_server_raised_is_kept_apart_from_its_tail_however_reads_split_it() -> None:
    """The root cause of a real vLLM's failure lies 60 lines above its end, out of the 20 lines a
    tail keeps; the exception lines ending its tracebacks are kept, in order, once each. Before,
    the termination message said only 'Engine core initialization failed. See root cause above.'"""
    data = _vllm_failing_to_load()
    expected = [
        "safetensors._safetensors_rust.SafetensorError: Error while deserializing header: invalid header length",
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    ]
    rng = random.Random(38)
    # Cut inside a "Traceback (most recent call last):" whose rest comes in one read with more lines
    # than the tail holds: the marker is whole only once its line ends, in that read.
    marker = data.index(b"Traceback (most recent call last)")
    cuts = [marker + n for n in range(1, len(b"Traceback (most recent call last)"))]
    for split in ["whole", "bytes", *range(20), *(f"at {cut}" for cut in cuts)]:
        tail = Tail(lines=20)
        keeper = LineKeeper(tail, ())
        if split == "whole":
            keeper.feed(data)  # one read: lines the tail cannot show are only counted, except a traceback's
        elif split == "bytes":
            _feed(keeper, data, 1, 1, rng)
        elif isinstance(split, str):
            cut = int(split.split()[1])
            keeper.feed(data[:cut])
            keeper.feed(data[cut:])
        else:
            _feed(keeper, data, 1, 2000, rng)
        keeper.close()
        assert tail.raised == expected, split
        assert not any(expected[0] in line for line in tail.lines), "the root cause is above the tail"


@pytest.mark.quick
def test_a_traceback_whose_first_line_a_read_cuts_is_still_followed() -> None:
    """The read that ends the "Traceback (most recent call last):" line holds more lines than the
    tail keeps: they are taken, not only counted, so its exception is seen."""
    frames = b"".join(b'  File "m%d.py", line %d, in f\n    g()\n' % (i, i) for i in range(30))
    data = b"starting\nTraceback (most recent call last):\n" + frames + b"ValueError: the root cause\n"
    data += b"".join(b"INFO shutting down %d\n" % i for i in range(30))
    marker = data.index(b"Traceback")
    for cut in range(marker + 1, marker + len(b"Traceback (most recent call last):")):
        tail = Tail(lines=20)
        keeper = LineKeeper(tail, ())
        keeper.feed(data[:cut])
        keeper.feed(data[cut:])
        keeper.close()
        assert tail.raised == ["ValueError: the root cause"], cut


@pytest.mark.quick
def test_a_traceback_cut_short_is_given_up_and_no_later_line_is_taken_for_its_exception() -> None:
    """A process killed while it printed its traceback: its prefix never ends a traceback. Later
    lines of other processes are not what it raised, and after a while chunks are only counted again."""
    tail = Tail(lines=5)
    keeper = LineKeeper(tail, ())
    keeper.feed(b'(Worker pid=7) Traceback (most recent call last):\n(Worker pid=7)   File "w.py", line 1\n')
    keeper.feed(b"".join(b"(API pid=1) INFO line %d\n" % i for i in range(2500)))
    keeper.feed(b"(Worker pid=7) not an exception: the traceback was given up\n")
    keeper.close()
    assert tail.raised == []
    assert tail.count == 2503


@pytest.mark.quick
def test_a_server_that_raises_many_exceptions_keeps_the_first_ones_and_its_last() -> None:
    tail = Tail(lines=5)
    keeper = LineKeeper(tail, ())
    for i in range(50):
        keeper.feed(
            f'Traceback (most recent call last):\n  File "x.py", line {i}\nValueError: number {i % 10}\n'.encode()
        )
    keeper.feed(b'Traceback (most recent call last):\n  File "y.py", line 1\nKeyboardInterrupt\n')
    keeper.close()
    assert tail.raised == [
        "ValueError: number 0",
        "ValueError: number 1",
        "ValueError: number 2",
        "KeyboardInterrupt",
    ]


# --- failure records -------------------------------------------------------------------------


def test_failure_records_are_capped_in_size_and_per_key_the_oldest_going_first(root: Path) -> None:
    cache = open_root(root, create=True)
    identity = PodIdentity(pod="p", node="n", host="h", pid=1)
    digest = "ab" * 16
    huge = {
        "reason": "compile-failed",
        "message": "m",
        "output_tail": ["y" * LINE_BYTES] * 40,
        "report": {"x": "z" * MiB},
    }
    written = []
    for index in range(RECORDS_PER_KEY + 5):
        path = record_failure(cache, digest, identity._replace(pid=1000 + index), huge)
        assert path is not None
        written.append(path.name)
    names = sorted(p.name for p in _records(root))
    assert len(names) == RECORDS_PER_KEY
    assert all(p.stat().st_size <= RECORD_BYTES for p in _records(root))
    kept = json.loads(_records(root)[-1].read_text())
    assert kept["output_tail"], "the newest output lines are kept"
    assert kept["output_tail_dropped"] > 0
    assert set(names) <= set(written)


def _planted(root: Path, size: int) -> Path:
    """A failure record as someone with write access to the volume could leave it: valid JSON, huge."""
    folder = root / "failures" / ("cd" * 16)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "20260101T000000Z.evil.1.json"
    with path.open("wb") as out:
        out.write(b'{"reason": "compile-failed", "message": "')
        block = b"A" * MiB
        for _ in range(size // MiB):
            out.write(block)
        out.write(b'", "output_tail": []}\n')
    return path


def _cli_peak(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], int]:
    """``cachemgr ARGS`` and its peak RSS in KiB (a fresh parent, so no other child's peak counts)."""
    script = (
        "import resource, subprocess, sys\n"
        "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, stdin=subprocess.DEVNULL)\n"
        "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr)\n"
        "sys.stderr.write('\\nPEAK %d\\n' % resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
        "sys.exit(done.returncode)\n"
    )
    argv = [sys.executable, "-c", script, sys.executable, "-m", "cachemgr", *args]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    peak = int(done.stderr.rsplit("PEAK ", 1)[1].split()[0])
    return done, peak


def test_ls_and_show_read_a_planted_huge_record_within_a_limit(root: Path) -> None:
    open_root(root, create=True)
    _planted(root, 100 * MiB)
    env = {**os.environ, "CACHEMGR_CACHE_ROOT": str(root), "CACHEMGR_LOG_FORMAT": "json"}
    for args in (("ls",), ("show", "cd" * 16)):
        done, peak = _cli_peak(*args, env=env)
        assert peak < RSS_BOUND_KIB, f"cachemgr {args[0]} peaked at {peak} KiB on a 100 MB record"
        assert "AAAAAAAAAAAAAAAA" not in done.stdout, "the record is not printed"
        assert "prune --failures" in done.stderr, done.stderr[-2000:]


# --- du and prune ----------------------------------------------------------------------------


def test_du_counts_failure_records_and_prune_failures_removes_them(pods: Cluster, root: Path) -> None:
    record = pods.work / "compiler.jsonl"
    pod = pods.start(
        "a", server_argv(free_port()), cache_root=root, options=_command(record, "--fail-with 3", seconds=0.2)
    )
    assert pod.wait_exit() == 70
    planted = _planted(root, 2 * MiB)
    on_disk = sum(p.stat().st_size for p in _records(root))
    env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)}

    du = json.loads(run_cli("du", "-o", "json", env=env).stdout)
    assert du["failures_bytes"] == on_disk
    assert du["cache_bytes"] >= on_disk
    assert du["prunable"]["failures"] == {"flag": "--failures", "items": 2, "bytes": on_disk}
    table = run_cli("du", env=env).stdout
    assert "cachemgr prune --failures" in table, table

    dry = run_cli("prune", "--failures", "--dry-run", env=env)
    assert dry.returncode == 0, dry.stderr
    assert planted.exists()
    assert "failures" in dry.stdout
    done = run_cli("prune", "--failures", "--yes", "-o", "json", env=env)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)["result"]
    assert result["freed_bytes"] == sum(i["bytes"] for i in result["removed"]) >= on_disk
    assert _records(root) == []
    assert json.loads(run_cli("du", "-o", "json", env=env).stdout)["failures_bytes"] == 0
