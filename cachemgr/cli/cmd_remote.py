"""``push``, ``pull``, ``ls --remote`` and ``prune --remote``: the remote tier from a shell or a CI job.

Parse, call :mod:`cachemgr.remote.ops`, render; tables on stdout, JSON with ``-o json``. A
remote that cannot be used is one line and exit 74, as a volume that cannot be used.

Every transfer, and the listing, runs in the child a pod's transfer runs in
(:class:`cachemgr.remote.bounded.BoundedRemote`): a store that trickles (one byte every half
second: no read timeout fires) holds it no longer than its budget (``--budget``, else
``CACHEMGR_REMOTE_BUDGET``, per entry), and SIGINT or SIGTERM kills it at once (exit 128+N).
"""

from __future__ import annotations

import argparse
import signal
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from types import FrameType
from typing import TYPE_CHECKING, Any, TypeVar

from cachemgr.cli.cmd_inspect import image_of, open_cache
from cachemgr.cli.cmd_run import trusted_keys
from cachemgr.cli.documents import emit_names
from cachemgr.cli.render import (
    Block,
    Column,
    Style,
    Table,
    Text,
    emit_data,
    entry_row,
    result,
    show,
    tell,
)
from cachemgr.core.errors import CacheMgrError, ConfigError, Interrupted, NotFoundError, UsageError
from cachemgr.core.printable import safe
from cachemgr.core.procs import StopFlag
from cachemgr.core.units import human_age, human_bytes, plural
from cachemgr.remote.config import (
    RemoteConfig,
    client_missing,
    malformed_credential,
    not_installed,
    remote_config,
)
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root

if TYPE_CHECKING:
    from cachemgr.remote.bounded import BoundedRemote
    from cachemgr.remote.ops import RemoteListing

T = TypeVar("T")
_STOPPING = (signal.SIGINT, signal.SIGTERM)


def _config(args: argparse.Namespace, environ: Mapping[str, str]) -> RemoteConfig:
    config = remote_config(args.remote or None, environ)
    if config is None:
        raise ConfigError(
            "no remote was given",
            remedy="pass --remote s3://bucket/prefix or set CACHEMGR_REMOTE (endpoint: CACHEMGR_REMOTE_ENDPOINT)",
        )
    missing = client_missing()
    if missing is not None:  # these commands are the remote tier: without its client, nothing to do (78)
        raise not_installed(config, missing)
    malformed = malformed_credential(environ)
    if malformed is not None:
        raise malformed
    return config


@contextmanager
def _remote_errors(config: RemoteConfig, doing: str) -> Iterator[None]:
    """boto3's exceptions -> one RemoteError line (exit 74); our own errors and a stop pass through."""
    try:
        yield
    except (CacheMgrError, InterruptedError):
        raise
    except Exception as error:
        from cachemgr.remote.client import describe

        raise describe(error, config, doing=doing) from error


def _open(args: argparse.Namespace, environ: Mapping[str, str]) -> Any:
    from cachemgr.remote.transfer import Remote

    config = _config(args, environ)
    with _remote_errors(config, "connecting"):
        return Remote(config)


def _call(remote: Any, doing: str, func: Callable[[], T]) -> T:
    with _remote_errors(remote.config, doing):
        return func()


class _Signals:
    """SIGINT and SIGTERM while a command uses the bucket: a flag the transfer's wait polls.

    Not Python's KeyboardInterrupt (nor SIGTERM's default): s3transfer's threads sit in their
    reads, and the transfer's child must go with its staging. The flag makes the wait kill the
    child at once; the download's staging is removed as for any failure; the command then
    ends with 128+N and one line (:meth:`check`).
    """

    def __init__(self) -> None:
        self.stop = StopFlag()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _Signals:
        for signum in _STOPPING:
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *_: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        self.received = self.received or signum
        self.stop.set()

    def check(self, during: str) -> None:
        """Interrupted (exit 128+N) once a signal came; ``during`` says what it cut short."""
        if self.stop.is_set():
            raise Interrupted(
                self.received or signal.SIGTERM,
                during=during,
                remedy="nothing to do: run it again to finish",
            )


def _bounded(args: argparse.Namespace, environ: Mapping[str, str]) -> BoundedRemote:
    """The remote, every transfer in a child killed at its budget: --budget, else the pods' own."""
    from cachemgr.remote.bounded import BoundedRemote

    config = _config(args, environ)
    budget = getattr(args, "budget", None)
    if budget is None:
        return BoundedRemote(config)
    if budget <= 0:
        raise UsageError(f"--budget {budget:g}s must be more than zero", remedy="pass e.g. --budget 10m")
    return BoundedRemote(config._replace(budget=budget), budget_name="--budget")


def _listing(remote: BoundedRemote, signals: _Signals, *, deadline: float) -> RemoteListing:
    from cachemgr.remote.ops import listing_from_wire

    try:
        return listing_from_wire(
            _call(remote, "listing", lambda: remote.listing(deadline=deadline, stop=signals.stop))
        )
    except (CacheMgrError, InterruptedError):
        signals.check(f"while listing {safe(remote.config.url)}; nothing was changed")
        raise


# --- ls --remote --------------------------------------------------------------------------------


def ls(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    remote = _bounded(args, environ)
    with _Signals() as signals:
        listing = _listing(remote, signals, deadline=time.monotonic() + remote.config.budget)

    def blocks() -> Iterator[Block]:
        rows = [
            entry_row(
                key=e.key, model=e.model, role=e.role, compiler=e.compiler, npu=e.npu, size=e.size_str,
                uploaded=human_age(e.uploaded_at), by=e.uploaded_by or "?", entry=e.entry,
            )
            for e in listing.entries
        ]  # fmt: skip
        yield Table(rows, _REMOTE_COLUMNS, empty=f"no entries in {safe(remote.config.url)}")
        text = f"{plural(len(rows), 'entry')}, {human_bytes(sum(e.size_bytes for e in listing.entries))}"
        if listing.uploads:
            text += (
                f"; {plural(len(listing.uploads), 'upload')} without a manifest (under way or cut short; "
                "'cachemgr prune --remote --stale-staging' removes those older than a day)"
            )
        yield Text(text)

    result(
        args,
        kind="RemoteEntryList",
        data=listing.to_json,
        blocks=blocks,
        names=lambda: (f"entry/{e.entry}" for e in listing.entries),
    )
    tell("warning", listing.warnings)
    return 0


_REMOTE_COLUMNS = (
    Column("key", "key"),
    Column("model", "model", shrink="model", least=10),
    Column("role", "role", wide=True),
    Column("compiler", "compiler"),
    Column("npu", "npu"),
    Column("size", "size", ">"),
    Column("uploaded", "uploaded"),
    Column("by", "by", shrink="tail", least=10),
    Column("entry", "entry", wide=True),
)


# --- push and pull ------------------------------------------------------------------------------


def push(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.ops.inspection import find_key
    from cachemgr.remote.client import RemoteFullError
    from cachemgr.remote.ops import PushResult
    from cachemgr.volume.entries import entry_names

    root = open_cache(args)
    remote = _bounded(args, environ)
    identity = PodIdentity.current(environ)
    names = [find_key(root, q).entry for q in args.keys] if args.keys else entry_names(root)
    results: list[PushResult] = []
    errors: list[CacheMgrError] = []
    with _Signals() as signals:
        for name in names:
            if name is None:
                raise NotFoundError(
                    "that key has no published entry here", remedy="'cachemgr ls' lists the entries"
                )
            done = f"{len(results) - len(errors)} of {plural(len(names), 'entry')} uploaded before it"
            signals.check(f"before uploading {name}; {done}, none in part")
            pushed, error = _push_one(
                remote, root, name, identity=identity, force=args.force, signals=signals
            )
            results.append(pushed)
            if error is None:
                continue
            errors.append(error)
            if len(names) > 1:  # said now, as push goes on; the last line counts them all
                tell("warning", [error.one_line() if name in error.what else f"{name}: {error.one_line()}"])
            if isinstance(error, RemoteFullError):
                break  # a full bucket refuses the next entries too
    _render_moves(args, [(r.entry, r.moved, r.error) for r in results], verb="uploaded")
    tell(
        "note",
        [
            f"the remote's {r.entry} was damaged ({r.moved.replaced}); this upload replaced it"
            for r in results
            if r.moved is not None and r.moved.replaced
        ],
    )
    if errors:
        raise _push_failure(errors, not_uploaded=len(names) - len(results) + len(errors), total=len(names))
    return 0


def _push_one(
    remote: BoundedRemote,
    root: Any,
    name: str,
    *,
    identity: PodIdentity,
    force: bool,
    signals: _Signals,
) -> tuple[Any, CacheMgrError | None]:
    """One entry's upload, within its own budget: its result, and its error if it failed."""
    from cachemgr.remote.ops import PushResult, push_entry

    upload = partial(
        push_entry,
        remote,
        root,
        name,
        identity=identity,
        force=force,
        deadline=time.monotonic() + remote.config.budget,
        stop=signals.stop,
    )
    try:
        moved = _call(remote, f"uploading {name}", upload)
    except (CacheMgrError, InterruptedError) as error:
        signals.check(
            f"while uploading {name}; that upload was abandoned before its manifest, so no reader takes it"
        )
        if not isinstance(error, CacheMgrError):
            raise  # only a signal stops a transfer, and check() said so
        return PushResult(name, None, error.one_line()), error
    return PushResult(name, moved), None


def _push_failure(errors: list[CacheMgrError], *, not_uploaded: int, total: int) -> CacheMgrError:
    """The error push exits with: the first one, with its exit code (73 for a full bucket, as for a
    full volume; 74 for a remote or volume that cannot be used), counting the entries left out."""
    from cachemgr.remote.client import RemoteFullError

    first = next((e for e in errors if isinstance(e, RemoteFullError)), errors[0])
    if total == 1:
        return first  # of several, each failure was said as it came: this line counts them
    return type(first)(
        f"{not_uploaded} of {plural(total, 'entry')} not uploaded; the first: {first.what}",
        remedy=f"{first.remedy}; then run push again (entries already uploaded are skipped)",
        **first.fields,
    )


def pull(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.remote.ops import find_remote, pull_entry

    root = open_root(open_cache(args).path, create=True)
    remote = _bounded(args, environ)
    identity = PodIdentity.current(environ)
    trusted = trusted_keys(args)  # a trusting pull publishes only what a trusted key signed
    deadline = time.monotonic() + remote.config.budget  # one for the entry: its listing and its transfer
    with _Signals() as signals:
        entry = find_remote(_listing(remote, signals, deadline=deadline), args.key)
        download = partial(
            pull_entry,
            root,
            remote,
            entry,
            identity=identity,
            deadline=deadline,
            stop=signals.stop,
            trusted=trusted,
        )
        try:
            outcome, moved = _call(remote, f"downloading {entry.entry}", download)
        except (CacheMgrError, InterruptedError):
            signals.check(
                f"while pulling entry {entry.entry}; the transfer was abandoned and its partial files "
                "removed, nothing was published"
            )
            raise
    verb = "downloaded" if outcome.published else "downloaded (already published here: kept that one)"
    _render_moves(args, [(entry.entry, moved, None)], verb=verb)
    return 0


def _render_moves(args: argparse.Namespace, rows_in: list[tuple[str, Any, str | None]], *, verb: str) -> None:
    style = Style.of(args)
    if style.data:
        emit_data(
            [
                {
                    "entry": name,
                    "result": "failed"
                    if error
                    else ("skipped" if moved.skipped else verb.split(maxsplit=1)[0]),
                    "files": moved.files if moved else 0,
                    "bytes": moved.bytes if moved else 0,
                    "seconds": round(moved.seconds, 3) if moved else 0,
                    "error": error,
                }
                for name, moved, error in rows_in
            ],
            style,
            kind="TransferList",
        )
        return
    if style.output == "name":
        emit_names(f"entry/{name}" for name, _, _ in rows_in)
        return
    rows = [
        {
            "entry": name,
            "files": moved.files if moved and not moved.skipped else "-",
            "size": human_bytes(moved.bytes) if moved and not moved.skipped else "-",
            "seconds": f"{moved.seconds:.1f}" if moved else "-",
            "mib_s": f"{moved.mib_per_s:.0f}" if moved and not moved.skipped else "-",
            "result": error
            or ("already in the remote" if moved.skipped else "replaced" if moved.replaced else verb),
        }
        for name, moved, error in rows_in
    ]
    cols = [
        Column(
            c,
            c,
            "<" if c in {"entry", "result"} else ">",
            shrink="head" if c in {"entry", "result"} else None,
            least=20,
        )
        for c in ("entry", "files", "size", "seconds", "mib_s", "result")
    ]
    show([Table(rows, cols, empty="no entries to push")], Style.of(args))


# --- prune --remote -----------------------------------------------------------------------------


def prune(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.remote.ops import plan_remote_prune, remove

    if args.damaged:
        raise UsageError(
            "prune --remote has no --damaged: a damaged remote entry is refused by every reader",
            remedy="remove it with 'cachemgr prune --remote --key KEY'",
        )
    if args.superseded:
        raise UsageError(
            "prune --remote has no --superseded: the bucket keeps no use records, and clusters still on the "
            "older server may download those entries",
            remedy="remove them by age ('cachemgr prune --remote --unused-for 30d') or by name (--key KEY)",
        )
    options = _remote_prune_options(args)
    compat = image_of(args, environ).require() if args.incompatible else None
    bounded = _bounded(args, environ)
    with _Signals() as signals:
        listing = _listing(bounded, signals, deadline=time.monotonic() + bounded.config.budget)
    plan = plan_remote_prune(listing, compat=compat, **options)
    rows = [
        {"entry": i.entry, "upload": i.upload_id or "-", "size": human_bytes(i.size_bytes), "reason": i.why}
        for i in plan
    ]
    if args.dry_run or not plan or not args.yes:
        _render_remote_plan(args, rows, executed=False)
        if plan and not args.dry_run and not args.yes:
            raise UsageError(
                f"prune --remote would remove {plural(len(plan), 'item')} from {bounded.config.url}",
                remedy="pass --yes to remove them, or --dry-run to only print the plan",
            )
        return 0
    remote = _open(args, environ)  # small requests, the manifest first: a signal ends them as they are
    for done, item in enumerate(plan):
        deadline = time.monotonic() + bounded.config.budget  # each removal's listing, as each push
        try:
            _call(remote, f"removing {item.entry}", partial(remove, remote, item, deadline=deadline))
        except CacheMgrError as error:
            if len(plan) == 1:
                raise
            raise type(error)(
                f"{done} of {plural(len(plan), 'item')} removed; then {error.what}",
                remedy=error.remedy,
                **error.fields,
            ) from None
    _render_remote_plan(args, rows, executed=True)
    return 0


def _remote_prune_options(args: argparse.Namespace) -> dict[str, Any]:
    older, keep = args.unused_for, args.keep_bytes  # parsed by the parser (seconds, bytes)
    options = {
        "keys": tuple(args.key),
        "older_than": older,
        "keep_bytes": keep,
        "stale_uploads": args.stale_staging,
    }
    if not (args.key or args.incompatible or older is not None or keep is not None or args.stale_staging):
        raise UsageError(
            "prune --remote needs at least one of --key, --incompatible, --unused-for, --keep-bytes, --stale-staging",
            remedy="say what may go, e.g. 'cachemgr prune --remote --unused-for 30d --dry-run'",
        )
    return options


def _render_remote_plan(args: argparse.Namespace, rows: list[dict[str, Any]], *, executed: bool) -> None:
    style = Style.of(args)
    if style.data:
        emit_data({"plan": rows, "executed": executed}, style, kind="RemotePrune")
        return
    if style.output == "name":
        emit_names(f"entry/{row['entry']}" for row in rows)
        return
    cols = [
        Column(
            c, c, ">" if c == "size" else "<", shrink="head" if c in {"entry", "reason"} else None, least=20
        )
        for c in ("entry", "upload", "size", "reason")
    ]
    done = f"removed {plural(len(rows), 'item')}" if executed else "(dry run: nothing removed)"
    blocks: list[Block] = [Table(rows, cols, empty="nothing to prune")]
    if rows:
        blocks.append(Text(f"plan: {plural(len(rows), 'item')}\n{done}"))
    show(blocks, style)
