"""The fuzzer's plants (tests/test_fuzz.py): generated content in what cachemgr reads, on the volume
and in the bucket, from a seeded ``random.Random`` so that a trial replays.

A plant picks a place and puts something there that no cachemgr writes:

* in a file cachemgr reads (a record, a manifest, an artifact, a lease marker...): bytes of a
  :data:`CONTENTS` kind: JSON nested 200,000 deep, 3 MB of empty arrays, the original record with
  a field turned into another type (:func:`mutated`), numbers out of range, ``NaN``, UTF-16,
  bytes that are not UTF-8, terminal escape sequences, a sparse file of hundreds of MiB, nothing;
* in place of a file or a folder (:data:`NODES`): a symlink to the canary outside the root (a file
  or a folder), a dangling link, a link to itself, a FIFO, a folder, a file, a chain of 1,100
  folders ending in a file or a link;
* under a name cachemgr lists (a use record, a holder record, a failure record, an attempt, an
  entry, the scan hints): a new file of hostile content, its name sometimes hostile too
  (newlines, escapes, bytes that are not UTF-8).

While pods run, what a live pod owns is removed (:func:`remove_live`): its use record or its key's
usage folder, its attempt's owner record, its lease marker and holder record.

In the bucket the same contents go into objects: an entry's manifest, one of its files, and a
manifest under an entry name nobody uploaded.

An operator's input is generated too (:func:`operator_template`, :func:`operator_columns`,
:func:`operator_path`): the templates, columns and ``--sort-by`` an operator types.
manifest under an entry name nobody uploaded; and damage a reader must call damage (a path no
volume can hold, a size the store does not hold, a manifest the store will not serve:
:data:`BUCKET_DAMAGE`), credentials as a careless Secret holds them, and pagination that loops.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachemgr_testkit.hostile import DEEP_JSON, deep_folder, file_leaf, link_leaf

CONTENTS = (
    "deep-array",
    "deep-object",
    "deep-mixed",
    "wide",
    "wrong-types",
    "random-json",
    "big-number",
    "nan",
    "utf16",
    "not-utf8",
    "escapes",
    "empty",
    "binary",
    "truncated",
    "huge-sparse",
)
# Weights: most plants are contents of records (what the readers parse, and where bugs hid),
# most of those the record itself with a field of another type or value.
CONTENT_WEIGHTS = dict.fromkeys(CONTENTS, 1) | {
    "wrong-types": 12,
    "escapes": 2,
    "deep-array": 2,
    "deep-object": 2,
}
NODES = (
    *("content",) * 14,
    "link-canary-file",
    "link-canary-dir",
    "link-dangling",
    "link-loop",
    "fifo",
    "folder",
    "deep-folder",
)
# Names of the layout directories: replacing one by a link or a file is refused with exit 74
# naming it (docs/design.md, "Nothing outside the root is touched"); so is a damaged layout
# marker (cachemgr-layout.json).
LAYOUT = ("entries", "staging", "leases", "usage", "failures", "quarantine", "trash")
ESCAPES = "\x1b[31mRED\x1b[0m \x1b]0;pwned\x07 \x1b[2J \r\n\t\u202e\u0000 \x9b31m"
HOSTILE_NAMES = ("\x1b[31mred", "line\nbreak", "tab\there", "rtl\u202egnp", "\x7fdel", "..hidden")
DEEP_FOLDER = 1_100
SPARSE_SIZES = (65 << 20, 300 << 20)


@dataclass(frozen=True)
class Plant:
    """One thing the fuzzer did: where (relative to the root, or the object's key), and what."""

    where: str
    kind: str

    def __str__(self) -> str:
        return f"{self.kind} at {self.where!r}"


def hostile_value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of a type no record field has, or of the right type and a hostile value."""
    choices: list[Callable[[], Any]] = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([-1, 0, 2**63, 10**19, -(10**19), 1.5, 1e308, -1e308, 5e-324]),
        lambda: rng.choice(["", ESCAPES, "../../../etc/passwd", "/abs/path", "a//b", "a" * 5000, "\udcff"]),
        lambda: [hostile_value(rng, depth + 1) for _ in range(rng.randint(0, 3))] if depth < 3 else [],
        lambda: (
            {rng.choice(["key", "files", "path", "size", ESCAPES]): hostile_value(rng, depth + 1)}
            if depth < 3
            else {}
        ),
        lambda: _nested(rng.choice([60, 126, 127, 129, 140])),
        # A record's text inside a record, as scan-hints.json holds key.json's: deep, or not JSON.
        lambda: rng.choice([json.dumps(_nested(rng.choice([129, 900]))), "{" * 5000, ESCAPES + "{"]),
    ]
    return rng.choice(choices)()


def _nested(levels: int) -> Any:
    value: Any = "bottom"
    for level in range(levels):
        value = [value] if level % 2 else {"k": value}
    return value


def mutated(rng: random.Random, doc: Any) -> Any:
    """``doc`` with one node, picked at random at any depth, replaced by :func:`hostile_value`."""
    if not isinstance(doc, dict | list) or not doc or rng.random() < 0.15:
        return hostile_value(rng)
    keys = list(doc) if isinstance(doc, dict) else list(range(len(doc)))
    key = rng.choice(keys)
    copy: Any = dict(doc) if isinstance(doc, dict) else list(doc)
    copy[key] = mutated(rng, doc[key])
    if isinstance(copy, dict) and rng.random() < 0.2:  # and sometimes a field gone
        copy.pop(rng.choice(keys), None)
    return copy


def _mutated_times(rng: random.Random, doc: Any) -> Any:
    for _ in range(rng.randint(1, 3)):
        doc = mutated(rng, doc)
    return doc


def content(rng: random.Random, kind: str, original: bytes | None) -> bytes:
    """The bytes of a :data:`CONTENTS` kind (``huge-sparse`` is made by :func:`plant_node`)."""
    doc: Any = None
    if original is not None:
        try:
            doc = json.loads(original)
        except (ValueError, RecursionError):  # what an earlier plant of the trial put there
            doc = None
    makers: dict[str, Callable[[], bytes]] = {
        "deep-array": lambda: DEEP_JSON,
        "deep-object": lambda: b'{"key":' * 100_000 + b"1" + b"}" * 100_000,
        "deep-mixed": lambda: json.dumps(_nested(rng.choice([129, 200, 900]))).encode(),
        "wide": lambda: b"[" + b"[]," * (1 << 20) + b"[]]",
        "wrong-types": lambda: json.dumps(_mutated_times(rng, doc if doc is not None else {})).encode(),
        "random-json": lambda: json.dumps(hostile_value(rng)).encode(),
        "big-number": lambda: rng.choice([b'{"size": 1e400}', b"[" + b"9" * 400 + b"]", b'{"a": -1e999}']),
        "nan": lambda: rng.choice([b'{"size": NaN}', b"[Infinity]", b'{"created_at": -Infinity}']),
        "utf16": lambda: (original or b"{}").decode("utf-8", "replace").encode("utf-16"),
        "not-utf8": lambda: b'{"key": "\xff\xfe\xc0\xaf", "files": []}',
        "escapes": lambda: (
            json.dumps(mutated(rng, doc) if doc is not None else {"pod": ESCAPES}, ensure_ascii=False).encode(
                "utf-8", "surrogatepass"
            )
            + ESCAPES.encode("utf-8", "surrogatepass")
        ),
        "empty": lambda: b"",
        "binary": lambda: rng.randbytes(rng.choice([1, 64, 4096])),
        "truncated": lambda: (original or b'{"key": "x"}')[: max(1, len(original or b"") // 2)],
    }
    return makers[kind]()


def plant_node(rng: random.Random, target: Path, *, canary: Path, kind: str) -> str:
    """Put a :data:`NODES` kind at ``target`` (whatever was there is removed first); the label."""
    original = _read_small(target)
    take_away(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    if kind == "content":
        what = rng.choices(list(CONTENT_WEIGHTS), weights=list(CONTENT_WEIGHTS.values()))[0]
        if what == "huge-sparse":
            with target.open("wb") as out:
                out.truncate(rng.choice(SPARSE_SIZES))
        else:
            target.write_bytes(content(rng, what, original))
        return what
    if kind == "link-canary-file":
        target.symlink_to(canary / "file.bin")
    elif kind == "link-canary-dir":
        target.symlink_to(canary)
    elif kind == "link-dangling":
        target.symlink_to(canary / "nothing-here")
    elif kind == "link-loop":
        target.symlink_to(target.name)
    elif kind == "fifo":
        os.mkfifo(target)
    elif kind == "folder":
        target.mkdir()
        (target / "inside.json").write_bytes(DEEP_JSON)
    elif kind == "deep-folder":
        target.mkdir()
        leaf = link_leaf(canary) if rng.random() < 0.5 else file_leaf(b'{"deep": true}')
        deep_folder(target, DEEP_FOLDER, leaf=leaf)
    return kind


def _read_small(path: Path) -> bytes | None:
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 1 << 20:
            return None
        return path.read_bytes()
    except OSError:
        return None


def take_away(path: Path) -> None:
    """Take away what is at ``path``, whatever it is (a published entry's folders are 0555: made
    writable first); nothing if nothing is there."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        os.chmod(path.parent, 0o755)
        path.unlink()
    elif path.is_dir():
        from cachemgr_testkit.hostile import remove_deep

        os.chmod(path.parent, 0o755)
        remove_deep(path)


def hostile_name(rng: random.Random, suffix: str = ".json", *, utf8: bool = False) -> str:
    """A name to plant under; ``utf8``: one an object key can take (S3 keys are UTF-8)."""
    name = rng.choice(HOSTILE_NAMES) if rng.random() < 0.5 else f"planted-{rng.randrange(1 << 16):x}"
    if not utf8 and rng.random() < 0.2:  # bytes that are not UTF-8, as a POSIX filesystem's name may hold
        name = os.fsdecode(os.fsencode(name) + b"\xff\xfe")
    return name + suffix


def volume_targets(root: Path, rng: random.Random) -> list[Path]:
    """Where a plant may go: everything under the root (files and folders, the layout's own
    among them) and new names in the folders cachemgr lists."""
    found: list[Path] = []
    for folder, dirs, files in os.walk(root):
        here = Path(folder)
        found += [here / name for name in (*dirs, *files)]
    digests = [p.name for p in (root / "usage").iterdir() if p.is_dir()] if (root / "usage").is_dir() else []
    digest = rng.choice(digests) if digests else "0" * 32
    found += [
        root / "scan-hints.json",
        root / "usage" / digest / hostile_name(rng),
        root / "usage" / digest / f"server-failed.0.{hostile_name(rng)}",
        root / "usage" / digest / f"recompiled.{hostile_name(rng, '')}",
        root / "leases" / f"{digest}.holder.json",
        root / "leases" / f"{digest}.progress.json",
        root / "failures" / digest / hostile_name(rng),
        root / "staging" / digest / f"{hostile_name(rng, '')}.json",
        root / "quarantine" / f"{hostile_name(rng, '')}.reason.json",
        root / "entries" / hostile_name(rng, ""),
        root / "trash" / hostile_name(rng, ""),
    ]
    return found


def pick_target(rng: random.Random, targets: list[Path], root: Path) -> Path:
    """A target, JSON records first: they are what the readers parse (and where bugs hid)."""
    layout = [root / name for name in (*LAYOUT, "cachemgr-layout.json")]
    # A layout folder replaced is refused everywhere with exit 74 naming it (documented, and a
    # trial that learns nothing else): rarely, and only as such.
    others = [t for t in targets if t not in layout]
    records = [t for t in others if t.suffix == ".json" or t.name.endswith(".lock")]
    pool = rng.choices([records, others, layout], weights=[24, 10, 1])[0] or others
    return rng.choice(pool)


def copy_tree(source: Path, target: Path) -> None:
    """A copy of a golden volume, modes, times and links kept (``cp -a``'s job, in Python)."""
    shutil.copytree(source, target, symlinks=True)


# --- operator input (issue 40): templates, columns and --sort-by as an operator may type them ------
#
# Generated over the fields ``ls`` and ``show`` documents have, and hostile: filters and ranges
# nested past the parser's bound (32) and 400 deep, numbers of 4,301 and 5,000 digits, slice steps
# of 0, odd unicode (right-to-left marks, combining accents, astral, lone surrogates) in quoted
# names, escapes and quotes where they do not belong, blocks left open. Literal text a template
# prints is printable (an operator's own escape sequence would be theirs); names, filters and
# headers may hold anything but NUL (argv cannot).

OPERATOR_FIELDS = (
    "items", "kind", "key", "short", "entry", "model", "role", "status", "size_bytes", "users", "pod",
    "node", "since", "generation", "versions", "compiler", "files", "inputs", "sources", "failures",
    "attempts", "signer", "apiVersion", "origin", "starts", "hits", "created_at", "missing",
)  # fmt: skip
ODD_NAMES = ("日本語", "e\u0301", "🙂", "\u202egnp", "\x1b[31m", "a\nb", "\udcff", "tab\there", "a.b", "a]b")
ODD_TEXT = ("日本語 ", "e\u0301", "🙂", "ǅ", " | ", "%s", "\\", "'", '"', ",", ":", "=", "KEY", "-")
DEPTHS = (1, 1, 2, 3, 31, 32, 33, 400)
ARGV_WORD = 32_000  # characters (4 bytes at most each): Linux takes no argv word past 128 KiB
DIGITS = (1, 1, 2, 19, 64, 65, 4301, 5000)


def _number(rng: random.Random) -> str:
    digits = rng.choice(DIGITS)
    text = str(rng.randint(1, 9)) + "".join(rng.choices("0123456789", k=digits - 1))  # one call: 5,000 digits
    return ("-" if rng.random() < 0.3 else "") + text


def _literal(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.35:
        return _number(rng) + rng.choice(["", "", ".5", "e3", f"e{_number(rng)}"])
    if pick < 0.7:
        quote = rng.choice("'\"")
        return quote + rng.choice([*OPERATOR_FIELDS, *ODD_NAMES, "published", ""]) + quote
    return rng.choice(["true", "false", "null", "nul", "@", "'open", "[", ")"])


def _step(rng: random.Random, depth: int) -> str:
    """One step of a path: a field, ``[*]``, an index, a slice, a quoted name, a filter, or garbage."""

    def sliced() -> str:
        ends = [rng.choice(["", _number(rng)]) for _ in range(2)]
        return f"[{ends[0]}:{ends[1]}{rng.choice(['', '', ':0', ':-0', f':{_number(rng)}', ':1'])}]"

    def quoted() -> str:
        quote = rng.choice("'\"")
        return f"[{quote}{rng.choice([*ODD_NAMES, *OPERATOR_FIELDS])}{quote}]"

    steps: list[tuple[float, Callable[[], str]]] = [
        (0.4, lambda: "." + rng.choice(OPERATOR_FIELDS)),
        (0.1, lambda: rng.choice(["[*]", ".*", "[ * ]"])),
        (0.1, lambda: f"[{_number(rng)}]"),
        (0.1, sliced),
        (0.08, quoted),
        (0.17, lambda: _filter(rng, depth)),
        (
            0.05,
            lambda: rng.choice(["..", "[", "[?(", ")", "]", "[]", "[?()]", ".", "['", "[-]", "[1:2:3:4]"]),
        ),
    ]
    weights, makers = zip(*steps, strict=True)
    return rng.choices(makers, weights=weights)[0]()


def _filter(rng: random.Random, depth: int) -> str:
    """``[?(@.a OP literal)]``, sometimes holding a filter in its path: nested ``depth`` deep."""
    inner = "@" + "".join(_step(rng, 0) for _ in range(rng.randint(0, 2)) if depth <= 1)
    if depth > 1:
        inner = "@." + rng.choice(OPERATOR_FIELDS) + _filter(rng, depth - 1)
    op = rng.choice(["==", "!=", "<", "<=", ">", ">=", "", "=", "=~"])
    right = f" {op} {_literal(rng)}" if op else ""
    return f"[?({inner}{right})]"


TAME_PATHS = (
    ".key", ".size_bytes", ".users[*].pod", "{.model}", ".generation.versions", ".users[0].since",
    '.files[?(@.a)]', "$.kind", ".status", ".users[-1:].node", '.generation[?(@ != "x")]',
)  # fmt: skip


def operator_path(rng: random.Random) -> str:
    """A JSONPath as ``--sort-by``, a custom column or a template's block takes it; a third of
    them one that works (a field of every item, of some, of none)."""
    if rng.random() < 0.33:
        return rng.choice(TAME_PATHS)
    return _path(rng)[:ARGV_WORD]


def _path(rng: random.Random) -> str:
    start = rng.choice(["", ".", "$", "@", "{", ""])
    steps = []
    for _ in range(rng.randint(1, 5)):
        if rng.random() < 0.15:
            steps.append(_filter(rng, rng.choice(DEPTHS)))
        else:
            steps.append(_step(rng, 1))
    path = start + "".join(steps).lstrip(".") if start == "" else start + "".join(steps)
    return path + ("}" if start == "{" else "")


TAME_TEMPLATES = (
    '{range .items[*]}{.short}{"\\t"}{.model}{"\\t"}{.status}{"\\n"}{end}',
    "{.items[*].model}",
    '{range .items[?(@.kind=="entry")]}{.entry} {.users[*].pod} {.generation}{"\\n"}{end}',
    "{$}",
    "{.items[-1:]}",
    '{range .items[*]}{.signer}{.origin}{.problem}{"\\n"}{end}',
    '{.inputs}{"\\n"}{.sources}{"\\n"}{.failures[*].reason}{"\\n"}{.attempts[*].pod}',
    "{.entry.status} {.entry.users[*].node} {.lease}",
)


def operator_template(rng: random.Random) -> str:
    """A ``-o jsonpath=`` template: text, blocks, literals, ranges (nested, sometimes past bound);
    a third of them a template that works, printing what the volume holds (hostile where planted)."""
    if rng.random() < 0.33:
        return rng.choice(TAME_TEMPLATES)
    return _template(rng)[:ARGV_WORD]


def _template(rng: random.Random) -> str:
    parts: list[str] = []
    for _ in range(rng.randint(1, 6)):
        pick = rng.random()
        if pick < 0.2:
            parts.append(rng.choice(ODD_TEXT))
        elif pick < 0.55:
            parts.append("{" + operator_path(rng).strip("{}") + "}")
        elif pick < 0.7:
            parts.append(
                rng.choice(['{"\\n"}', '{"\\t"}', "{'text'}", '{"\\""}', '{"\\x1b"}', "{'}", "{@}", "{$}"])
            )
        elif pick < 0.95:
            depth = rng.choice(DEPTHS)
            over = rng.choice(["{range .items[*]}", "{range @.users[*]}", "{range $.items[*]}", "{range .*}"])
            if over.startswith("{range $") and depth > 3:
                over = "{range .items[*]}"  # ranges over $ inside ranges over $ multiply: a few, not 400
            body = "{" + operator_path(rng).strip("{}") + "}"
            ends = "{end}" * (depth if rng.random() < 0.9 else max(0, depth - 1))
            parts.append(over * depth + body + ends)
        else:
            parts.append(rng.choice(["{", "}", "{end}", "{range}", "{range .items[*]}", "{{}}"]))
    return "".join(parts)


def operator_columns(rng: random.Random) -> str:
    """A ``-o custom-columns=`` spec: headers (odd ones too) and paths, separated by commas."""
    columns = []
    for _ in range(rng.randint(1, 4)):
        header = rng.choice(["KEY", "SIZE", "日本", "A B", "E\u0301", "", "X:Y", "H,I"])
        columns.append(f"{header}:{operator_path(rng)}" if rng.random() < 0.95 else header)
    return ",".join(columns)[:ARGV_WORD]


# --- live plants: what a running pod owns, removed while it runs (issue 40) -----------------------

# A use record (or its key's whole usage folder) of a serving pod; the owner record of a compiling
# pod's attempt; the lease marker and holder record it holds. Each is written again at the pod's
# next beat; until then nobody may act on its absence (no entry in use removed, no live staging
# taken over or removed, no second compile of the key).
LIVE_KINDS = ("use-record", "usage-folder", "owner-record", "lease-marker", "lease-holder")


def live_records(root: Path, pod: str, pid: int) -> dict[str, list[Path]]:
    """What the running ``cachemgr`` process ``pid`` of pod ``pod`` owns on the volume, by
    :data:`LIVE_KINDS` (records are named ``<pod>.<pid>...``; a plain pod name is its own file name)."""
    stem = f"{pod}.{pid}"
    # [!.]*: a folder the Swapper has set aside for a moment (``.swapped-N``) is not the pod's; it
    # goes back under its own name, and the pod never writes under the aside name again.
    uses = sorted(root.glob(f"usage/[!.]*/{stem}.json"))
    owners = sorted(p for p in root.glob(f"staging/[!.]*/{stem}.*.json") if p.with_suffix("").is_dir())
    holders = [p for p in sorted(root.glob("leases/*.holder.json")) if _names(p, pod, pid)]
    markers = [p.with_name(p.name.removesuffix(".holder.json") + ".lock") for p in holders]
    return {
        "use-record": uses,
        "usage-folder": sorted({p.parent for p in uses}),
        "owner-record": owners,
        "lease-marker": [p for p in markers if p.is_file()],
        "lease-holder": holders,
    }


def _names(record: Path, pod: str, pid: int) -> bool:
    try:
        data = json.loads(record.read_text())
    except (OSError, ValueError, RecursionError):  # a planted one: nested 100,000 deep (seed 7373 trial 188)
        return False
    return isinstance(data, dict) and data.get("pod") == pod and data.get("pid") == pid


def remove_live(rng: random.Random, owned: dict[str, list[Path]], root: Path) -> list[Plant]:
    """Remove one to all of the kinds a live pod owns (each path of a kind chosen), as a peer with
    ``usage/`` writable or a stray cleanup would; the plants say what went."""
    kinds = [kind for kind in LIVE_KINDS if owned.get(kind)]
    if "usage-folder" in kinds and "use-record" in kinds:
        kinds.remove(rng.choice(["usage-folder", "use-record"]))  # the record goes with its folder
    chosen = rng.sample(kinds, rng.randint(1, len(kinds))) if kinds else []
    plants = []
    for kind in chosen:
        for path in owned[kind]:
            if _taken(path):
                plants.append(Plant(str(path.relative_to(root)), f"live:{kind}"))
    return plants


def _taken(path: Path, tries: int = 5) -> bool:
    """Remove ``path`` as an adversary would, trying again while the live pod writes into the
    folder being emptied (its heartbeat restoring a record there: ENOTEMPTY, seed 7373 trial 63);
    False if the pod won every time (nothing stayed removed) or it went on its own."""
    for _ in range(tries):
        try:
            take_away(path)
        except FileNotFoundError:
            return False
        except OSError as error:
            if error.errno != errno.ENOTEMPTY:
                raise
            continue
        return True
    return False


# --- the bucket: damage that must be called damage (issue 40) ------------------------------------

# What a manifest may claim that no reader takes, each damage the compiling pod replaces: a path no
# volume or object key can hold (past NAME_MAX, 600 levels, a lone surrogate), a size the store
# does not hold (a PiB); and the manifest object encrypted SSE-C, which the store will not serve.
BUCKET_DAMAGE = ("path-long", "path-deep", "path-surrogate", "lying-size", "refused")
LYING_SIZE = 1 << 50


def damaged_manifest(rng: random.Random, kind: str, doc: dict[str, Any]) -> dict[str, Any]:
    """A remote manifest (as JSON) with the damage of a :data:`BUCKET_DAMAGE` kind ("refused" is
    the store's doing: the manifest unchanged)."""
    files = list(doc.get("files") or [])
    if kind == "lying-size" and files:
        index = rng.randrange(len(files))
        files[index] = {**files[index], "size": LYING_SIZE}
    elif kind.startswith("path-"):
        path = {
            "path-long": "artifacts/" + "n" * rng.choice([256, 300, 1000]),
            "path-deep": "artifacts/" + "d/" * rng.choice([600, 1000]) + "x.rbln",
            "path-surrogate": "artifacts/\udcff" + rng.choice(["", ".rbln", "/x"]),
        }[kind]
        files.append({"path": path, "size": 1, "xxh3": "0" * 32})
    return {**doc, "files": files}


def malformed_credentials(rng: random.Random) -> dict[str, str]:
    """A credential variable as 'kubectl create secret --from-file' makes it (its value a marker
    no message may show): a trailing newline, a CRLF, or a space inside."""
    name = rng.choice(["AWS_SESSION_TOKEN", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID"])
    marker = f"FuzzSecret{rng.randrange(1 << 32):08x}"
    return {name: marker + rng.choice(["\n", "\r\n", " x"])}
