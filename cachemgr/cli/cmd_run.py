"""``run``, ``warm``, ``key`` and ``demo``: thin wrappers over the library."""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.core.trust_env import SIGNING_KEY_ENV, TRUSTED_KEYS_ENV
from cachemgr.core.units import parse_duration
from cachemgr.key.cachekey import KeyRequest, Strategy, compute_key
from cachemgr.runtime.state import DEFAULT_STATE_DIR
from cachemgr.volume.lease_defaults import CONFIRM_ENV
from cachemgr.volume.lease_defaults import DEFAULT_DURATION as DEFAULT_LEASE_DURATION

if TYPE_CHECKING:
    from cachemgr.core.signing import SecretKey, TrustedKeys


def key_request(args: argparse.Namespace, server_argv: list[str], environ: Mapping[str, str]) -> KeyRequest:
    strategy: Strategy | None = args.strategy
    return KeyRequest(
        argv=server_argv,
        role=args.role,
        strategy=strategy,
        compile_cmd=args.compile_cmd,
        key_env=tuple(args.key_env),
        compiler_version=args.compiler_version,
        npu_type=args.npu_type,
        environ=environ,
    )


def cache_root(args: argparse.Namespace) -> Path:
    if not args.cache_root:
        raise ConfigError(
            "no cache volume was given",
            remedy="set CACHEMGR_CACHE_ROOT (or --cache-root) to where the compile cache PVC is mounted",
        )
    # Absolute once, here: view links and records made from it must not depend on the cwd.
    return Path(os.path.abspath(args.cache_root))


def _seconds(value: float | None, flag: str, *, positive: bool = True) -> float | None:
    """A duration option, parsed by the parser (cachemgr.cli.main.duration), checked for sign."""
    if value is None:
        return None
    if positive and value <= 0:
        raise UsageError(
            f"{flag} must be positive, not {value:g}", remedy=f"pass a positive {flag}, e.g. 30s"
        )
    return value


def _env_seconds(value: float | None, flag: str, env: str, environ: Mapping[str, str]) -> float | None:
    """The flag, else its environment variable (a bad value there is configuration: exit 78)."""
    if value is not None:
        return _seconds(value, flag, positive=False)
    text = environ.get(env) or ""
    if not text:
        return None
    try:
        return parse_duration(text)
    except ValueError as error:
        raise ConfigError(
            f"{env}: {error}", remedy=f"set {env} to seconds or a duration such as 2s"
        ) from None


def trusted_keys(args: argparse.Namespace) -> TrustedKeys | None:
    """``--trusted-keys`` / CACHEMGR_TRUSTED_KEYS parsed (exit 78 naming it when malformed, empty, or
    given twice with other keys); None: the open mode, which is the variable unset."""
    text = _TRUSTED.value(args)
    if text is None:
        return None
    from cachemgr.core.signing import parse_trusted_keys

    where = f"{_TRUSTED.env} (--trusted-keys)"
    trusted = parse_trusted_keys(text, where=where)
    if not trusted:  # set to blanks: a typo must not turn trust off
        raise ConfigError(
            f"{where} is set but names no key",
            remedy="give public keys NAME:BASE64, or unset it for the open mode",
        )
    return trusted


class _TrustSetting(NamedTuple):
    """A trust setting, given by its variable or its option: read by :meth:`value`."""

    attr: str
    env: str
    flag: str
    what: str
    other: str
    decides: str
    unset: str

    def value(self, args: argparse.Namespace) -> str | None:
        """The setting as given; None when neither the variable nor the option is set.

        Set but empty is refused (78): an empty ConfigMap key or an unset shell variable expands
        to "", the likeliest mistake, and it must not turn trust off. And one setting decides: the
        chart renders trust as the variable and passes ``cachemgr.extraArgs`` as options, so an
        option saying otherwise (however argparse lets it be abbreviated) must not override what
        the chart renders.
        """
        value: str | None = getattr(args, self.attr, None)
        if value is None:
            return None
        if not value:  # blanks are read as what they are (no key; no such file)
            raise ConfigError(
                f"{self.env} ({self.flag}) is set but empty",
                remedy=f"give {self.what}, or unset it: unset, not empty, is {self.unset}",
            )
        given = os.environ.get(self.env)
        if given is not None and value != given:
            raise ConfigError(
                f"{self.flag} gives {self.other} than {self.env}: one setting decides {self.decides}",
                remedy=f"set {self.env} alone (the chart's trust values) and drop {self.flag} from the "
                "command line (cachemgr.extraArgs)",
            )
        return value


_TRUSTED = _TrustSetting(
    "trusted_keys", TRUSTED_KEYS_ENV, "--trusted-keys", "public keys NAME:BASE64", "other keys",
    "what a pod trusts", "the open mode",
)  # fmt: skip
_SIGNING = _TrustSetting(
    "signing_key_file", SIGNING_KEY_ENV, "--signing-key-file", "a secret key file",
    "another key file", "what a pod signs with", "a pod that does not sign",
)  # fmt: skip


def trust_keys(args: argparse.Namespace) -> tuple[SecretKey | None, TrustedKeys | None]:
    """The signing key (loaded and checked now: a bad one stops the pod before anything runs) and
    the keys trusted, which must list the signing key's own."""
    trusted = trusted_keys(args)
    key_file = _SIGNING.value(args)
    if key_file is None:
        return None, trusted
    from cachemgr.core.signing import load_secret_key

    where = f"{_SIGNING.env} (--signing-key-file)"
    secret = load_secret_key(Path(key_file), where=where)
    if trusted is not None:
        trusted = trusted.signing_with(secret.public, where=f"{where} and CACHEMGR_TRUSTED_KEYS")
    return secret, trusted


def run_options(args: argparse.Namespace, *, warm: bool, environ: Mapping[str, str] | None = None) -> Any:
    from cachemgr.ops.meter import interval_from
    from cachemgr.remote.config import remote_config  # stdlib only; boto3 loads on a miss
    from cachemgr.runtime.options import RunOptions

    environ = os.environ if environ is None else environ
    lease = _seconds(args.lease_duration, "--lease-duration") or DEFAULT_LEASE_DURATION
    heartbeat = _seconds(args.lease_heartbeat, "--lease-heartbeat")
    if heartbeat is not None and heartbeat >= lease:
        raise UsageError(
            f"--lease-heartbeat {heartbeat:g}s must be shorter than --lease-duration {lease:g}s",
            remedy="use a heartbeat of about a third of the lease",
        )
    signing_key, trusted = trust_keys(args)
    return RunOptions(
        cache_root=cache_root(args),
        state_dir=Path(os.path.abspath(args.state_dir or DEFAULT_STATE_DIR)),
        on_miss=args.on_miss,
        lease_duration=lease,
        lease_heartbeat=heartbeat,
        lease_confirm=_env_seconds(args.lease_confirm, "--lease-confirm", CONFIRM_ENV, environ),
        wait_timeout=_seconds(args.wait_timeout, "--wait-timeout"),
        expected_size=args.expected_size,
        space_check=args.space_check,
        auto_prune=args.auto_prune,
        verify=args.verify,
        health_url=args.health_url,
        stall_timeout=_seconds(args.stall_timeout, "--stall-timeout") or 1800.0,
        status_port=args.status_port,
        warm=warm,
        hook=warm and _warm_hook(environ),
        progress_interval=interval_from(args.progress_interval, environ),
        remote=remote_config(args.remote, environ),
        signing_key=signing_key,
        trusted=trusted,
        prefetch=_prefetch_mode(args.prefetch),
        on_server_failure=_server_failure_policy(args.on_server_failure, environ),
    )


def _warm_hook(environ: Mapping[str, str]) -> bool:
    """``CACHEMGR_WARM_HOOK``: the chart sets ``pre-upgrade`` on a warm Job it runs as a Helm hook."""
    value = environ.get("CACHEMGR_WARM_HOOK", "")
    if value not in {"", "pre-upgrade"}:
        raise ConfigError(
            f"CACHEMGR_WARM_HOOK {value[:40]!r} is not a hook cachemgr knows",
            remedy="leave it to the chart, which sets pre-upgrade on a warm Job it runs as a Helm hook, or unset it",
        )
    return value == "pre-upgrade"


_DIGITS = re.compile("[0-9]{1,6}")  # ASCII only: str.isdigit() takes '²', which int() refuses


def _server_failure_policy(given: list[str] | None, environ: Mapping[str, str]) -> int | None:
    """``--on-server-failure`` / ``CACHEMGR_ON_SERVER_FAILURE``: ``off`` (None) or ``set-aside-after N``."""
    from_env = given is None
    text = (environ.get("CACHEMGR_ON_SERVER_FAILURE") or "off") if given is None else " ".join(given)
    words = text.replace("=", " ").split()
    if words == ["off"]:
        return None
    if (
        len(words) == 2
        and words[0] == "set-aside-after"
        and _DIGITS.fullmatch(words[1])
        and int(words[1]) > 0
    ):
        return int(words[1])
    what = (
        f"{'CACHEMGR_ON_SERVER_FAILURE' if from_env else '--on-server-failure'} {text[:40]!r} is not a policy"
    )
    remedy = "use 'off' (the default) or 'set-aside-after N', N a whole number of pre-ready exits, e.g. 3"
    raise ConfigError(what, remedy=remedy) if from_env else UsageError(what, remedy=remedy)


def _prefetch_mode(value: str | None) -> Any:
    """``--prefetch`` / ``CACHEMGR_PREFETCH``: ``auto`` (the default) or ``off``."""
    mode = (value or "auto").strip().lower()
    if mode not in {"auto", "off"}:
        raise UsageError(
            f"--prefetch (CACHEMGR_PREFETCH) must be auto or off, not {mode[:40]!r}",
            remedy="set CACHEMGR_PREFETCH=auto (read ahead after the launch) or off",
        )
    return mode


def run(args: argparse.Namespace, server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.runtime.runner import run as run_pod

    return run_pod(
        key_request(args, server_argv, environ),
        run_options(args, warm=False, environ=environ),
        environ=environ,
    )


def warm(args: argparse.Namespace, server_argv: list[str], environ: Mapping[str, str]) -> int:
    """The same flow as ``run`` for a Job; ends with one line: what it compiled or found, size, time."""
    from cachemgr.runtime.runner import Runner

    started = time.monotonic()
    runner = Runner(
        key_request(args, server_argv, environ),
        run_options(args, warm=True, environ=environ),
        environ=environ,
    )
    code = runner.run()
    if code == 0:
        from cachemgr.cli.render import emit

        space = warm_space(runner)  # before the summary, which stays the Job's last line
        if space:
            emit(space)
        emit(warm_summary(runner, seconds=time.monotonic() - started))
    return code


def warm_space(runner: Any) -> str:
    """Before anything rolls (a warm Job ahead of the rollout, a pre-upgrade hook): do both
    generations fit, and what is left. A warning, never a failure: the entry is published
    (cachemgr.ops.rollout.RolloutSpace says why)."""
    from cachemgr.core.errors import CacheMgrError
    from cachemgr.core.log import get_logger
    from cachemgr.core.printable import safe
    from cachemgr.ops.space import warm_space as measure
    from cachemgr.volume.layout import open_root

    log = get_logger("cachemgr.warm")
    if runner.key is None:
        return ""
    try:
        space = measure(open_root(runner.options.cache_root, create=False), runner.key)
    except (OSError, CacheMgrError) as error:  # advice only: the Job's entry is published all the same
        log.warning("rollout_space_unknown", error=str(error))
        return ""
    line = safe(space.line())
    (log.warning if space.tight else log.info)("rollout_space", message=line, **space.to_json())
    return line


def warm_summary(runner: Any, *, seconds: float) -> str:
    """``warm: compiled entry NAME (1.0 MiB in 5 files) in 3.1s; published``, or what it found."""
    from cachemgr.core.printable import safe
    from cachemgr.core.units import human_bytes, plural
    from cachemgr.ops.scan import scan_entry
    from cachemgr.volume.layout import open_root

    name = runner.state.current.entry or ""
    metrics = runner.metrics
    try:
        info = scan_entry(open_root(runner.options.cache_root, create=False), name) if name else None
    except OSError:
        info = None
    size = f" ({human_bytes(info.size_bytes)} in {plural(info.files, 'file')})" if info is not None else ""
    if metrics.compiles:
        how = f"compiled entry {safe(name)}{size} in {seconds:.1f}s (the compile took {metrics.compile_seconds:.1f}s); published"
    elif metrics.remote_hits:
        how = f"downloaded entry {safe(name)}{size} from the remote tier in {seconds:.1f}s; published"
    elif metrics.misses:
        how = f"entry {safe(name)}{size} was published by another pod while this Job waited ({seconds:.1f}s)"
    else:
        how = f"entry {safe(name)}{size} was already published: nothing compiled ({seconds:.1f}s)"
    return f"warm: {how}"


def key(args: argparse.Namespace, server_argv: list[str], environ: Mapping[str, str]) -> int:
    from cachemgr.cli.render import (
        INPUT_COLUMNS,
        Pairs,
        Table,
        Text,
        input_notes,
        input_rows,
        result,
        tell,
    )  # not on run's hit path
    from cachemgr.key.describe import keyed_pairs

    computed = compute_key(key_request(args, server_argv, environ))
    tell("warning", computed.notes)

    def blocks() -> Any:
        yield Pairs([("key", computed.digest), ("entry", computed.entry_name)])
        yield Table(input_rows(computed.inputs, computed.sources), INPUT_COLUMNS)
        notes = input_notes(computed.sources)
        if notes:
            yield Text("\n".join(notes))
        pairs = keyed_pairs(computed)  # what is keyed: the rules, the flags left out or keyed as given
        if pairs:
            yield Pairs(pairs)

    result(args, kind="Key", data=computed.to_json, blocks=blocks)
    return 0


def demo(args: argparse.Namespace, _server_argv: list[str], environ: Mapping[str, str]) -> int:
    _require_standin()
    if args.remote:
        from cachemgr.cli.demo_remote import run_remote_demo

        return run_remote_demo(Path(args.dir), compile_seconds=args.compile_seconds, environ=environ)
    from cachemgr.cli.demo import run_demo

    return run_demo(Path(args.dir), compile_seconds=args.compile_seconds, environ=environ)


def _require_standin() -> None:
    """The demo runs the stand-in compiler and server, a package of their own that no image has."""
    import importlib.util

    if importlib.util.find_spec("cachemgr_standin") is None:
        raise ConfigError(
            "cachemgr demo needs the stand-in compiler and server (the cachemgr-standin package), "
            "which this installation does not have (the modelserver image never carries them)",
            remedy="run scripts/demo from a clone of the cachemgr repository, or pip install its standin/ directory",
        )
