"""Where the remote is and how long a pod may spend on it: parsed without importing boto3.

``--remote s3://bucket/prefix`` (or ``CACHEMGR_REMOTE``) turns the tier on. The endpoint of a
non-AWS store comes from ``CACHEMGR_REMOTE_ENDPOINT`` (else ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, which boto3 reads itself); region and credentials from the standard AWS
chain (environment, profile, IRSA web identity, instance metadata), so nothing secret passes
through cachemgr.

Time is bounded twice: every request by a connect and a read timeout
(``CACHEMGR_REMOTE_TIMEOUT``, default 10s; botocore retries twice), and the whole remote
attempt of a pod (manifest, objects, retries; or an upload) by ``CACHEMGR_REMOTE_BUDGET``
(default 10m): at it the transfer is abandoned (:mod:`cachemgr.remote.bounded`) and the pod
compiles. ``CACHEMGR_REMOTE_UPLOAD_WAIT`` (default 30s) is how long a stopping ``run`` waits
for its background upload. A bad value of any of them is a configuration error (exit 78)
naming the variable; a bad ``--remote`` flag a usage error (64).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

from cachemgr.core.errors import CacheMgrError, ConfigError, UsageError
from cachemgr.core.units import parse_duration

ENV_URL = "CACHEMGR_REMOTE"
ENV_ENDPOINT = "CACHEMGR_REMOTE_ENDPOINT"
ENV_TIMEOUT = "CACHEMGR_REMOTE_TIMEOUT"
ENV_BUDGET = "CACHEMGR_REMOTE_BUDGET"
ENV_UPLOAD_WAIT = "CACHEMGR_REMOTE_UPLOAD_WAIT"
DEFAULT_TIMEOUT = 10.0
DEFAULT_BUDGET = 600.0
DEFAULT_UPLOAD_WAIT = 30.0
# What installs the tier's client (boto3 and botocore); the modelserver extra includes it too.
INSTALL = "pip install 'cachemgr[remote]'"


class RemoteConfig(NamedTuple):
    """An ``s3://bucket/prefix`` and the limits on using it."""

    url: str
    bucket: str
    prefix: str  # "" or "some/prefix/" (always ends with "/")
    endpoint: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    budget: float = DEFAULT_BUDGET
    upload_wait: float = DEFAULT_UPLOAD_WAIT

    def entry_prefix(self, entry_name: str) -> str:
        """Object key prefix of one entry: ``<prefix>entries/<entry name>/``."""
        return f"{self.prefix}entries/{entry_name}/"

    @property
    def entries_prefix(self) -> str:
        return f"{self.prefix}entries/"


def parse_url(url: str, *, variable: str | None = None) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (``bucket``, ``some/prefix/``).

    A bad ``--remote`` is a usage error (64); a bad ``variable`` (``CACHEMGR_REMOTE``) is
    configuration (78), and the message names it.
    """
    scheme, sep, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    given = f"{variable}={url!r}" if variable else f"remote {url!r}"
    where = f"set {variable} to" if variable else "pass --remote"
    if scheme != "s3" or not sep or not bucket:
        raise _bad(
            f"{given} is not an s3://BUCKET[/PREFIX] URL",
            remedy=f"{where} s3://bucket/prefix (any S3-compatible store; its endpoint in {ENV_ENDPOINT})",
            variable=variable,
        )
    prefix = "/".join(part for part in prefix.split("/") if part)
    if any(part in {".", ".."} for part in prefix.split("/")):
        raise _bad(
            f"{given} has '.' or '..' in its prefix", remedy=f"{where} a plain prefix", variable=variable
        )
    return bucket, prefix + "/" if prefix else ""


def remote_config(url: str | None, environ: Mapping[str, str]) -> RemoteConfig | None:
    """The remote from ``--remote`` or ``CACHEMGR_REMOTE``; None when neither is set (the default).

    Every variable is checked here, before anything runs: a bad one is exit 78 naming it.
    """
    from_flag = bool(url)
    url = url or environ.get(ENV_URL) or None
    if not url:
        return None
    bucket, prefix = parse_url(url, variable=None if from_flag else ENV_URL)
    return RemoteConfig(
        url=url,
        bucket=bucket,
        prefix=prefix,
        endpoint=environ.get(ENV_ENDPOINT) or None,
        timeout=_seconds(environ, ENV_TIMEOUT, DEFAULT_TIMEOUT),
        budget=_seconds(environ, ENV_BUDGET, DEFAULT_BUDGET),
        upload_wait=_seconds(environ, ENV_UPLOAD_WAIT, DEFAULT_UPLOAD_WAIT, zero_ok=True),
    )


def _bad(what: str, *, remedy: str, variable: str | None) -> CacheMgrError:
    return ConfigError(what, remedy=remedy) if variable else UsageError(what, remedy=remedy)


def _seconds(environ: Mapping[str, str], name: str, default: float, *, zero_ok: bool = False) -> float:
    text = environ.get(name)
    if not text:
        return default
    accepted = f"seconds or a duration such as 30s, 10m or 1h{' (0: none)' if zero_ok else ''}"
    try:
        value = parse_duration(text)
    except ValueError:
        raise ConfigError(f"{name}={text!r} is not a duration", remedy=f"set {name} to {accepted}") from None
    if value < 0 or (value == 0 and not zero_ok):
        raise ConfigError(
            f"{name}={text!r} must be {'zero or more' if zero_ok else 'more than zero'}",
            remedy=f"set {name} to {accepted}",
        )
    return value


def client_missing() -> str | None:
    """The module the remote tier needs and this install lacks (``boto3``, ``botocore``), or None.

    Found without importing either (``find_spec`` of a top-level module only searches the path),
    so the check costs a miss a few stat calls and a hit nothing: it runs only where the remote
    is about to be used.
    """
    from importlib.util import find_spec

    for name in ("boto3", "botocore"):
        if find_spec(name) is None:
            return name
    return None


def not_installed(config: RemoteConfig, missing: str) -> ConfigError:
    """The one line for a remote configured where its client is not installed (exit 78)."""
    return ConfigError(
        f"remote {config.url} needs {missing}, which this install of cachemgr lacks",
        remedy=f"install the remote tier's client ({INSTALL}; the modelserver image has it), or unset {ENV_URL}",
        problem="not-installed",
    )


# The AWS chain's credential variables: their values go into request headers and signatures,
# and never into a message of ours (cachemgr.remote.client.describe removes them).
CREDENTIAL_VARIABLES = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
)


def malformed_credential(environ: Mapping[str, str]) -> ConfigError | None:
    """A credential variable whose value no store can accept (exit 78), named, its value never shown.

    Every AWS credential is printable ASCII without spaces; a value with a newline (a Secret
    made with ``kubectl create secret --from-file`` keeps the file's last one), a space or a
    control character would be sent as a header botocore refuses (and quotes whole in its error).
    """
    for name in CREDENTIAL_VARIABLES:
        value = environ.get(name) or ""
        odd = [c for c in value if not "!" <= c <= "~"]
        if not odd:
            continue
        what = (
            "a trailing newline"
            if value.rstrip("\r\n") != value and value.rstrip("\r\n").isprintable()
            else f"{len(odd)} character(s) no credential has (spaces, control characters or non-ASCII)"
        )
        return ConfigError(
            f"{name} holds {what}; its value is not shown",
            remedy=f"set {name} to the credential alone: 'kubectl create secret --from-file' keeps the "
            "file's last newline (use --from-literal, or write the file with printf '%s')",
            problem="credentials",
            variable=name,
        )
    return None


def redact(text: str, environ: Mapping[str, str]) -> str:
    """``text`` with every credential variable's value (as set, or stripped) replaced by its name."""
    for name in CREDENTIAL_VARIABLES:
        value = environ.get(name) or ""
        for form in {value, value.strip(), repr(value.encode(errors="replace"))[2:-1]}:
            if (
                len(form) >= 8
            ):  # shorter is no AWS credential (20 and 40 characters), and would blank out words
                text = text.replace(form, f"<{name}>")
    return text
