"""``push``, ``pull``, ``ls --remote`` and ``prune --remote``: the remote tier from a shell or a CI job.

Parse, call :mod:`cachemgr.remote.ops`, render; tables on stdout, JSON with ``-o json``. A
remote that cannot be used is one line and exit 74, as a volume that cannot be used.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import Any, TypeVar

from cachemgr.cli.cmd_inspect import image_of, open_cache
from cachemgr.cli.cmd_run import trusted_keys
from cachemgr.cli.render import (
    Block,
    Column,
    Style,
    Table,
    Text,
    emit_data,
    emit_names,
    entry_row,
    plural,
    result,
    show,
    tell,
)
from cachemgr.core.errors import CacheMgrError, ConfigError, NotFoundError, UsageError
from cachemgr.core.printable import safe
from cachemgr.core.units import human_age, human_bytes
from cachemgr.remote.config import RemoteConfig, remote_config
from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root

T = TypeVar("T")


def _config(args: argparse.Namespace, environ: Mapping[str, str]) -> RemoteConfig:
    config = remote_config(args.remote or None, environ)
    if config is None:
        raise ConfigError(
            "no remote was given",
            remedy="pass --remote s3://bucket/prefix or set CACHEMGR_REMOTE (endpoint: CACHEMGR_REMOTE_ENDPOINT)",
        )
    return config


@contextmanager
def _remote_errors(config: RemoteConfig, doing: str) -> Iterator[None]:
    """boto3's exceptions -> one RemoteError line (exit 74); our own errors pass through."""
    try:
        yield
    except CacheMgrError:
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


# --- ls --remote --------------------------------------------------------------------------------


def ls(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.remote.ops import list_remote

    remote = _open(args, environ)
    listing = _call(remote, "listing", lambda: list_remote(remote))

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
        args, data=listing.to_json, blocks=blocks, names=lambda: (f"entry/{e.entry}" for e in listing.entries)
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
    from cachemgr.remote.ops import PushResult, push_entry
    from cachemgr.volume.entries import entry_names

    root = open_cache(args)
    remote = _open(args, environ)
    identity = PodIdentity.current(environ)
    names = [find_key(root, q).entry for q in args.keys] if args.keys else entry_names(root)
    results: list[PushResult] = []
    errors: list[CacheMgrError] = []
    for name in names:
        if name is None:
            raise NotFoundError(
                "that key has no published entry here", remedy="'cachemgr ls' lists the entries"
            )
        try:
            moved = _call(
                remote,
                f"uploading {name}",
                partial(push_entry, remote, root, name, identity=identity, force=args.force),
            )
            results.append(PushResult(name, moved))
        except CacheMgrError as error:
            results.append(PushResult(name, None, error.one_line()))
            errors.append(error)
            if isinstance(error, RemoteFullError):
                break  # a full bucket refuses the next entries too
    _render_moves(args, [(r.entry, r.moved, r.error) for r in results], verb="uploaded")
    if errors:
        raise _push_failure(errors, not_uploaded=len(names) - len(results) + len(errors), total=len(names))
    return 0


def _push_failure(errors: list[CacheMgrError], *, not_uploaded: int, total: int) -> CacheMgrError:
    """The error push exits with: the first one, with its exit code (73 for a full bucket, as for a
    full volume; 74 for a remote or volume that cannot be used), counting the entries left out."""
    from cachemgr.remote.client import RemoteFullError

    first = next((e for e in errors if isinstance(e, RemoteFullError)), errors[0])
    if not_uploaded == 1:
        return first
    return type(first)(
        f"{not_uploaded} of {plural(total, 'entry')} not uploaded; the first: {first.what}",
        remedy=f"{first.remedy}; then run push again (entries already uploaded are skipped)",
        **first.fields,
    )


def pull(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.remote.ops import find_remote, list_remote, pull_entry

    root = open_root(open_cache(args).path, create=True)
    remote = _open(args, environ)
    entry = find_remote(_call(remote, "listing", lambda: list_remote(remote)), args.key)
    identity = PodIdentity.current(environ)
    trusted = trusted_keys(args)  # a trusting pull publishes only what a trusted key signed
    outcome, moved = _call(
        remote,
        f"downloading {entry.entry}",
        lambda: pull_entry(root, remote, entry, identity=identity, trusted=trusted),
    )
    verb = "downloaded" if outcome.published else "downloaded (already published here: kept that one)"
    _render_moves(args, [(entry.entry, moved, None)], verb=verb)
    return 0


def _render_moves(args: argparse.Namespace, rows_in: list[tuple[str, Any, str | None]], *, verb: str) -> None:
    if args.output in ("json", "yaml"):
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
            args.output,
        )
        return
    if args.output == "name":
        emit_names(f"entry/{name}" for name, _, _ in rows_in)
        return
    rows = [
        {
            "entry": name,
            "files": moved.files if moved and not moved.skipped else "-",
            "size": human_bytes(moved.bytes) if moved and not moved.skipped else "-",
            "seconds": f"{moved.seconds:.1f}" if moved else "-",
            "mib_s": f"{moved.mib_per_s:.0f}" if moved and not moved.skipped else "-",
            "result": error or ("already in the remote" if moved.skipped else verb),
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
    from cachemgr.remote.ops import list_remote, plan_remote_prune, remove

    if args.damaged:
        raise UsageError(
            "prune --remote has no --damaged: a damaged remote entry is refused by every reader",
            remedy="remove it with 'cachemgr prune --remote --key KEY'",
        )
    options = _remote_prune_options(args)
    compat = image_of(args, environ).require() if args.incompatible else None
    remote = _open(args, environ)
    listing = _call(remote, "listing", lambda: list_remote(remote))
    plan = plan_remote_prune(listing, compat=compat, **options)
    rows = [
        {"entry": i.entry, "upload": i.upload_id or "-", "size": human_bytes(i.size_bytes), "reason": i.why}
        for i in plan
    ]
    if args.dry_run or not plan or not args.yes:
        _render_remote_plan(args, rows, executed=False)
        if plan and not args.dry_run and not args.yes:
            raise UsageError(
                f"prune --remote would remove {plural(len(plan), 'item')} from {remote.config.url}",
                remedy="pass --yes to remove them, or --dry-run to only print the plan",
            )
        return 0
    for item in plan:
        _call(remote, f"removing {item.entry}", partial(remove, remote, item))
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
    if args.output in ("json", "yaml"):
        emit_data({"plan": rows, "executed": executed}, args.output)
        return
    if args.output == "name":
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
    show(blocks, Style.of(args))
