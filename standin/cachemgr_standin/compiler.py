"""STAND-IN for the RBLN compiler (rebel-compiler / optimum-rbln export). Not the real tool.

``python -m cachemgr_standin.compiler --output-dir DIR [--model M] [--files N] [--bytes TOTAL]
[--seconds S] [--record FILE] [--fail-with CODE] [--quota-exceeded] [--hang] [--long-line SIZE]
[--progress-bar] [--any-key VALUE ...]``

Writes N deterministic ``*.rbln`` files (the later half under ``submodule/``) totalling TOTAL bytes,
then ``rbln_config.json`` last, so DIR becomes a compiled model directory that the stand-in server
(and vllm-rbln's ``is_compiled_dir``) accepts. Any other ``--key value`` is folded into the content.

This module also holds what the stand-in server shares with it (artifact bytes, digests, the
record file, fault knobs, progress pacing); everything is stdlib so both start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import re
import resource
import signal
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

BANNER = "STAND-IN RBLN compiler (cachemgr_standin, not rebel-compiler)"
RBLN_CONFIG = "rbln_config.json"  # vllm_rbln.utils.optimum.paths.RBLN_CONFIG_FILE
SUBDIR = "submodule"
STANDIN_MARK = "cachemgr_standin stand-in artifact, not produced by rebel-compiler"

DEFAULT_FILES = 4
DEFAULT_BYTES = 1 << 20
DEFAULT_COMPILE_SECONDS = 2.0
# Share of each graph's time slot spent burning CPU; the rest sleeps. A compile is CPU-bound
# (stall detectors watch CPU time), but the stand-in must stay light on a CI runner.
CPU_FRACTION = 0.25
_CHUNK = 1 << 20
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_NEGATIVE_NUMBER = re.compile(r"^-\d")


class KnobError(ValueError):
    """A stand-in knob (flag or STANDIN_* variable) has an unusable value."""


# ---------------------------------------------------------------------------
# Knobs
# ---------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``1048576``, ``64k``, ``1M``, ``2GiB`` (binary units)."""
    match = _SIZE_RE.match(text)
    if match is None:
        raise KnobError(f"not a size: {text!r} (use bytes, or a k/M/G suffix)")
    return int(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise KnobError(f"{name}={raw!r} is not a number") from None
    if value < 0:
        raise KnobError(f"{name}={raw!r} must not be negative")
    return value


def env_int(name: str, default: int, *, minimum: int = 1) -> int:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise KnobError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise KnobError(f"{name}={raw!r} must be at least {minimum}")
    return value


def env_size(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    return parse_size(raw) if raw else default


def env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


# ---------------------------------------------------------------------------
# Free-form `--key value` flags (the compiler's extras, the server's vLLM flags)
# ---------------------------------------------------------------------------

FlagValue = str | bool


def looks_like_flag(arg: str) -> bool:
    """``--x`` and ``-x`` are flags; ``-1`` is a (negative) value, as argparse treats it."""
    return arg.startswith("-") and arg != "-" and not _NEGATIVE_NUMBER.match(arg)


def normalize_flag_name(token: str) -> str:
    """``--max_model_len`` and ``--max-model-len`` are one flag, as vLLM's parser makes them."""
    return token.lstrip("-").replace("_", "-")


def parse_flag_tokens(
    tokens: Sequence[str],
    *,
    boolean: frozenset[str] = frozenset(),
    multi: frozenset[str] = frozenset(),
    aliases: dict[str, str] | None = None,
) -> tuple[dict[str, FlagValue | tuple[str, ...]], list[str]]:
    """Split tokens into ``{name: value}`` and positionals; the last repeat of a flag wins.

    A flag takes the next token as its value unless it is ``--k=v``, named in ``boolean``,
    or followed by another flag; names in ``multi`` take every value up to the next flag.
    """
    aliases = aliases or {}
    flags: dict[str, FlagValue | tuple[str, ...]] = {}
    positionals: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        i += 1
        if not looks_like_flag(token):
            positionals.append(token)
            continue
        name, has_value, value = token.partition("=")
        key = normalize_flag_name(name)
        key = aliases.get(key, key)
        if has_value:
            flags[key] = value
        elif key in multi:
            values: list[str] = []
            while i < len(tokens) and not looks_like_flag(tokens[i]):
                values.append(tokens[i])
                i += 1
            flags[key] = tuple(values)
        elif key in boolean or key.startswith(("no-", "enable-", "disable-")):
            flags[key] = True
        elif i < len(tokens) and not looks_like_flag(tokens[i]):
            flags[key] = tokens[i]
            i += 1
        else:
            flags[key] = True
    return flags, positionals


# ---------------------------------------------------------------------------
# Deterministic artifact bytes and digests
# ---------------------------------------------------------------------------


def split_sizes(total: int, count: int) -> list[int]:
    """``count`` sizes summing to ``total``, the first ones one byte larger when it does not divide."""
    base, extra = divmod(total, count)
    return [base + (1 if i < extra else 0) for i in range(count)]


def layout(count: int) -> list[str]:
    """Relative paths of the compiled files; the later half sits in a subdirectory, as
    optimum-rbln puts submodules, so publishers must copy trees, not just top-level files."""
    first_sub = count - count // 2
    return [f"{SUBDIR}/graph_{i:03d}.rbln" if i >= first_sub else f"graph_{i:03d}.rbln" for i in range(count)]


def artifact_chunks(seed: str, size: int) -> Iterator[bytes]:
    """The bytes of one artifact, in chunks: a readable header, then SHAKE-256 output keyed on
    ``seed``. A pure function of (seed, size), so two compiles of one config are byte-identical."""
    data = f"STANDIN-RBLN {seed}\n".encode()[:size]
    produced = len(data)
    if data:
        yield data
    index = 0
    while produced < size:
        n = min(_CHUNK, size - produced)
        yield hashlib.shake_256(f"{seed}\0{index}".encode()).digest(n)
        produced += n
        index += 1


def artifact_bytes(seed: str, size: int) -> bytes:
    return b"".join(artifact_chunks(seed, size))


def artifact_seed(model: str, signature: str, name: str) -> str:
    return f"model={model} sig={signature} file={name}"


class EntryDigest:
    """sha256 over (name, size, bytes) entries fed in name order.

    One definition for a compiled directory (names are relative paths) and a mega-cache bundle
    (names are graph names), so "what was written" and "what was loaded" compare directly.
    """

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.entries = 0
        self.size = 0

    def add(self, name: str, size: int, chunks: Iterable[bytes]) -> None:
        self._hash.update(f"{name}\0{size}\0".encode())
        for chunk in chunks:
            self._hash.update(chunk)
        self.entries += 1
        self.size += size

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def digest_entries(entries: dict[str, bytes]) -> str:
    digest = EntryDigest()
    for name in sorted(entries):
        digest.add(name, len(entries[name]), [entries[name]])
    return digest.hexdigest()


# ---------------------------------------------------------------------------
# Record file, pacing, faults
# ---------------------------------------------------------------------------


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """One ``write`` on an O_APPEND descriptor, so lines from concurrent processes never interleave."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line.rstrip("\n") + "\n").encode())
    finally:
        os.close(fd)


def record_event(record: str | None, event: str, **fields: Any) -> None:
    """Append ``{"event": ..., "pid": ..., ..., "time": ...}`` to the record file, if one is set."""
    if not record:
        return
    # A path handed through the pod's descriptor (/proc/<pid>/fd/<n>: cachemgr pins the attempt's
    # folder) is recorded as the folder it is, so a reader of the record sees the volume's path.
    shown = {
        name: os.path.realpath(value) if isinstance(value, str) and value.startswith("/proc/") else value
        for name, value in fields.items()
    }
    payload: dict[str, Any] = {"event": event, "pid": os.getpid(), **shown, "time": time.time()}
    append_line(record, json.dumps(payload, sort_keys=True))


def progress(index: int, total: int, suffix: str = "", *, bar: bool = False) -> None:
    """Printed as graph ``index`` starts, so a watcher sees work begin, not only end.

    ``bar``: drawn as a terminal progress bar (tqdm's way): each frame starts with ``\r`` and
    none ends the line until the last graph is done, so a reader waiting for a newline sees nothing.
    """
    if bar:
        sys.stdout.write(
            f"\r[standin] compiling graph {index}/{total}{suffix} [{'#' * index}{'.' * (total - index)}]"
        )
        sys.stdout.flush()
        return
    print(f"[standin] compiling graph {index}/{total}{suffix}", flush=True)


def print_long_line(size: int) -> None:
    """``size`` bytes on stdout with no newline, as a compiler dumping a tensor's values prints them."""
    piece = b"0.0000, " * (_CHUNK // 8)
    left = size
    while left > 0:
        sys.stdout.buffer.write(piece[:left])
        left -= min(left, len(piece))
    sys.stdout.buffer.flush()


def spend(seconds: float) -> None:
    """Take ``seconds`` like a compile step: CPU for a share of it, then sleep.

    Sleeping in small pieces is not needed: signal handlers run during ``time.sleep`` and a
    raising handler ends it, so SIGTERM stays prompt.
    """
    if seconds <= 0:
        return
    start = time.monotonic()
    busy_until = start + seconds * CPU_FRACTION
    block = bytes(1 << 16)
    burner = hashlib.sha256()
    while time.monotonic() < busy_until:
        burner.update(block)
    remaining = start + seconds - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)


@dataclass(frozen=True)
class Faults:
    """What to do in the middle of a compile (after ``fault_point`` graphs)."""

    exit_code: int | None = None
    quota_exceeded: bool = False
    hang: bool = False
    exit_label: str = "--fail-with"

    def any(self) -> bool:
        return self.exit_code is not None or self.quota_exceeded or self.hang


def fault_point(total: int) -> int:
    """The graph count after which faults fire: mid-compile, with at least one file written."""
    return max(1, total // 2)


def hang_forever() -> NoReturn:
    """Block with no output and no CPU; signal handlers still run (SIGTERM still ends it)."""
    while True:
        signal.pause()


def die_by_signal(signum: int) -> NoReturn:
    """Die by ``signum`` with its default action, so the parent sees -N (a shell, 128+N)."""
    sys.stdout.flush()
    sys.stderr.flush()
    # A test that makes the stand-in die by SIGQUIT must not drop core files in its cwd.
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    with contextlib.suppress(ValueError, OSError):  # SIGKILL/SIGSTOP cannot be reset, nor need to be
        signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
    os._exit(128 + signum)  # only reached if the signal's default action is to ignore it


def die(code: int) -> NoReturn:
    """Exit with ``code``; a negative code dies by that signal, as an OOM kill (-9) would."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code < 0:
        die_by_signal(-code)
    raise SystemExit(code)


def fire_faults(faults: Faults, next_path: str) -> None:
    """Act on the fault knobs; ``next_path`` is the file the compile would write next."""
    if faults.quota_exceeded:
        # The real failure is an OSError escaping the write; raising one prints the same
        # traceback and last line (`OSError: [Errno 122] Disk quota exceeded: '<path>'`), exit 1.
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), next_path)
    if faults.hang:
        hang_forever()
    if faults.exit_code is not None:
        print(
            f"[standin] error: compilation failed (stand-in fault {faults.exit_label}={faults.exit_code})",
            file=sys.stderr,
            flush=True,
        )
        die(faults.exit_code)


# ---------------------------------------------------------------------------
# Compiled directories
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CompileSpec:
    model: str
    signature: str
    files: int
    total_bytes: int
    seconds: float
    args: dict[str, Any]


def write_artifact(path: Path, seed: str, size: int) -> str:
    """Write one artifact, streaming, and return its sha256."""
    path.parent.mkdir(parents=True, exist_ok=True)
    file_hash = hashlib.sha256()
    with path.open("wb") as out:
        for chunk in artifact_chunks(seed, size):
            out.write(chunk)
            file_hash.update(chunk)
    return file_hash.hexdigest()


def rbln_config_text(spec: CompileSpec, files: list[dict[str, Any]]) -> str:
    """Deterministic JSON (sorted keys, no times or pids): equal configs give equal bytes.

    As optimum-rbln writes it (``RBLNModelConfig._prepare_for_serialization``): a ``cls_name``, and
    ``_compile_cfgs`` naming each ``<compiled_model_name>.rbln`` of this folder; a submodule's graphs
    sit in ``<submodule>/``, named by the nested config under that key (``utils/submodule.py``).
    """
    config: dict[str, Any] = {
        "_standin": STANDIN_MARK,
        "cls_name": "RBLNStandinModelConfig",
        "model": spec.model,
        "signature": spec.signature,
        "compile_args": spec.args,
        "files": files,
        "_compile_cfgs": [compile_cfg(f["path"]) for f in files if "/" not in f["path"]],
    }
    nested = [compile_cfg(f["path"].split("/", 1)[1]) for f in files if f["path"].startswith(f"{SUBDIR}/")]
    if nested:
        config[SUBDIR] = {"cls_name": "RBLNStandinSubmoduleConfig", "_compile_cfgs": nested}
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def compile_cfg(file_name: str) -> dict[str, Any]:
    """One RBLNCompileConfig as ``asdict`` writes it: the graph's name without ``.rbln``."""
    return {
        "compiled_model_name": file_name.removesuffix(".rbln"),
        "input_info": None,
        "npu": None,
        "num_devices": None,
    }


def named_graphs(config: dict[str, Any], prefix: str = "") -> list[str]:
    """Every ``.rbln`` path the config's ``_compile_cfgs`` name, its submodules' included."""
    names = [
        f"{prefix}{cfg.get('compiled_model_name', 'compiled_model')}.rbln"
        for cfg in config.get("_compile_cfgs") or []
    ]
    for key, value in sorted(config.items()):
        if isinstance(value, dict) and "cls_name" in value:
            names += named_graphs(value, f"{prefix}{key}/")
    return names


def write_compiled_dir(
    out_dir: Path, spec: CompileSpec, faults: Faults, *, fault_dir: Path | None = None, bar: bool = False
) -> None:
    """Compile graph by graph into ``out_dir``; ``rbln_config.json`` goes last, so the directory
    counts as compiled only once every ``.rbln`` file is in it.

    ``fault_dir`` is the directory a quota fault names, when the volume that would really run
    out is not ``out_dir`` (the server stages in TMPDIR, but a quota bites on the cache volume).
    """
    names = layout(spec.files)
    sizes = split_sizes(spec.total_bytes, spec.files)
    per_graph = spec.seconds / spec.files
    listed: list[dict[str, Any]] = []
    for index, (name, size) in enumerate(zip(names, sizes, strict=True), start=1):
        progress(index, spec.files, bar=bar)
        spend(per_graph)
        sha = write_artifact(out_dir / name, artifact_seed(spec.model, spec.signature, name), size)
        listed.append({"path": name, "size": size, "sha256": sha})
        if index == fault_point(spec.files) and faults.any():
            following = names[index] if index < len(names) else RBLN_CONFIG
            fire_faults(faults, str((fault_dir or out_dir) / following))
    if bar:
        print(flush=True)  # the bar's line ends once every graph is done
    (out_dir / RBLN_CONFIG).write_text(rbln_config_text(spec, listed), encoding="utf-8")


class CompiledDirError(RuntimeError):
    """A directory with ``rbln_config.json`` whose listed files are missing or damaged."""


def _read_listed(root: Path, entry: dict[str, Any]) -> bytes:
    rel = str(entry["path"])
    path = root / rel
    if not path.is_file():
        # The wording of optimum-rbln's _raise_missing_compiled_file_error.
        raise CompiledDirError(
            f"The rbln model folder is missing the required '{rel}' file. "
            "These files are necessary for loading the rbln model."
        )
    data = path.read_bytes()
    if len(data) != entry["size"] or hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CompiledDirError(f"compiled file {path} is truncated or damaged (stand-in check)")
    return data


def load_compiled_dir(root: Path) -> tuple[str, int, int]:
    """Read every artifact of a compiled directory; return (digest, files, bytes).

    The digest covers the listed ``.rbln`` files and ``rbln_config.json`` itself, and nothing
    else, so metadata a publisher adds next to them does not change it.
    """
    config_bytes = (root / RBLN_CONFIG).read_bytes()
    config = json.loads(config_bytes)
    if not isinstance(config, dict) or config.get("_standin") != STANDIN_MARK:
        raise CompiledDirError(f"{root / RBLN_CONFIG} was not written by a cachemgr stand-in")
    for name in named_graphs(config):
        if not (root / name).is_file():
            # optimum-rbln's _load_compiled_models (modeling_base.py 205-211)
            raise FileNotFoundError(
                f"Expected RBLN compiled model '{Path(name).name}' not found at '{(root / name).parent}'. "
                "Please ensure all models specified in `rbln_config` are present."
            )
    entries = {RBLN_CONFIG: config_bytes}
    for entry in config["files"]:
        entries[str(entry["path"])] = _read_listed(root, entry)
    digest = digest_entries(entries)
    return digest, len(entries), sum(len(data) for data in entries.values())


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cachemgr_standin.compiler",
        description=f"{BANNER}. Any other --key value is folded into the artifact content.",
    )
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--model", default="standin-model")
    parser.add_argument("--files", type=int, default=None, help="default: $STANDIN_ARTIFACT_FILES or 4")
    parser.add_argument(
        "--bytes", default=None, help="total .rbln bytes; default $STANDIN_ARTIFACT_BYTES or 1M"
    )
    parser.add_argument("--seconds", type=float, default=None, help="default $STANDIN_COMPILE_SECONDS or 2")
    parser.add_argument("--record", default=None, help="append JSON event lines here")
    parser.add_argument("--fail-with", type=int, default=None, metavar="CODE")
    parser.add_argument("--quota-exceeded", action="store_true")
    parser.add_argument("--hang", action="store_true")
    parser.add_argument(
        "--long-line", default=None, metavar="SIZE", help="first print SIZE bytes without a newline (64M)"
    )
    parser.add_argument("--progress-bar", action="store_true", help="draw progress as a \\r bar, not lines")
    return parser


def _spec_from(ns: argparse.Namespace, extras: dict[str, Any]) -> CompileSpec:
    files = ns.files if ns.files is not None else env_int("STANDIN_ARTIFACT_FILES", DEFAULT_FILES)
    total = (
        parse_size(ns.bytes) if ns.bytes is not None else env_size("STANDIN_ARTIFACT_BYTES", DEFAULT_BYTES)
    )
    seconds = (
        ns.seconds
        if ns.seconds is not None
        else env_float("STANDIN_COMPILE_SECONDS", DEFAULT_COMPILE_SECONDS)
    )
    if files < 1 or seconds < 0:
        raise KnobError("--files must be at least 1 and --seconds not negative")
    key = json.dumps({"model": ns.model, "args": extras}, sort_keys=True)
    signature = hashlib.sha256(key.encode()).hexdigest()[:16]
    return CompileSpec(ns.model, signature, files, total, seconds, extras)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    # A native compiler dies by SIGTERM/SIGINT; Python would turn SIGINT into a traceback.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    print(BANNER, file=sys.stderr, flush=True)
    parser = _parser()
    ns, unknown = parser.parse_known_args(args)
    extras, stray = parse_flag_tokens(unknown)
    if stray:
        parser.error(f"unexpected arguments: {' '.join(stray)}")
    try:
        spec = _spec_from(ns, {k: list(v) if isinstance(v, tuple) else v for k, v in extras.items()})
    except KnobError as exc:
        parser.error(str(exc))
    out_dir: Path = ns.output_dir
    record_event(ns.record, "compile", output_dir=str(out_dir), argv=args)
    faults = Faults(exit_code=ns.fail_with, quota_exceeded=ns.quota_exceeded, hang=ns.hang)
    out_dir.mkdir(parents=True, exist_ok=True)
    if ns.long_line is not None:
        print_long_line(parse_size(ns.long_line))
    write_compiled_dir(out_dir, spec, faults, bar=ns.progress_bar)
    digest, files, size = load_compiled_dir(out_dir)
    record_event(ns.record, "compiled", output_dir=str(out_dir), digest=digest, files=files, bytes=size)
    print(f"[standin] compiled {spec.model} into {out_dir} ({files} files, {size} bytes, digest {digest})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
