"""Where the remote is and how long a pod may spend on it: parsed without importing boto3.

``--remote s3://bucket/prefix`` (or ``CACHEMGR_REMOTE``) turns the tier on. The endpoint of a
non-AWS store comes from ``CACHEMGR_REMOTE_ENDPOINT`` (else ``AWS_ENDPOINT_URL_S3`` /
``AWS_ENDPOINT_URL``, which boto3 reads itself); region and credentials from the standard AWS
chain (environment, profile, IRSA web identity, instance metadata), so nothing secret passes
through cachemgr.

Time is bounded twice: every request by a connect and a read timeout
(``CACHEMGR_REMOTE_TIMEOUT``, default 10s; botocore retries twice), and a whole download by
``CACHEMGR_REMOTE_BUDGET`` (default 10m): past it the pod stops downloading and compiles.
``CACHEMGR_REMOTE_UPLOAD_WAIT`` (default 30s) is how long a stopping ``run`` waits for its
background upload.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from cachemgr.core.errors import UsageError
from cachemgr.core.units import parse_duration

ENV_URL = "CACHEMGR_REMOTE"
ENV_ENDPOINT = "CACHEMGR_REMOTE_ENDPOINT"
ENV_TIMEOUT = "CACHEMGR_REMOTE_TIMEOUT"
ENV_BUDGET = "CACHEMGR_REMOTE_BUDGET"
ENV_UPLOAD_WAIT = "CACHEMGR_REMOTE_UPLOAD_WAIT"
DEFAULT_TIMEOUT = 10.0
DEFAULT_BUDGET = 600.0
DEFAULT_UPLOAD_WAIT = 30.0


@dataclass(frozen=True, kw_only=True)
class RemoteConfig:
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


def parse_url(url: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (``bucket``, ``some/prefix/``)."""
    scheme, sep, rest = url.partition("://")
    bucket, _, prefix = rest.partition("/")
    if scheme != "s3" or not sep or not bucket:
        raise UsageError(
            f"remote {url!r} is not an s3://BUCKET[/PREFIX] URL",
            remedy="pass --remote s3://bucket/prefix (any S3-compatible store; its endpoint in CACHEMGR_REMOTE_ENDPOINT)",
        )
    prefix = "/".join(part for part in prefix.split("/") if part)
    if any(part in {".", ".."} for part in prefix.split("/")):
        raise UsageError(f"remote {url!r} has '.' or '..' in its prefix", remedy="use a plain prefix")
    return bucket, prefix + "/" if prefix else ""


def remote_config(url: str | None, environ: Mapping[str, str]) -> RemoteConfig | None:
    """The remote from ``--remote`` or ``CACHEMGR_REMOTE``; None when neither is set (the default)."""
    url = url or environ.get(ENV_URL) or None
    if not url:
        return None
    bucket, prefix = parse_url(url)
    return RemoteConfig(
        url=url,
        bucket=bucket,
        prefix=prefix,
        endpoint=environ.get(ENV_ENDPOINT) or None,
        timeout=_seconds(environ, ENV_TIMEOUT, DEFAULT_TIMEOUT),
        budget=_seconds(environ, ENV_BUDGET, DEFAULT_BUDGET),
        upload_wait=_seconds(environ, ENV_UPLOAD_WAIT, DEFAULT_UPLOAD_WAIT, zero_ok=True),
    )


def _seconds(environ: Mapping[str, str], name: str, default: float, *, zero_ok: bool = False) -> float:
    text = environ.get(name)
    if not text:
        return default
    try:
        value = parse_duration(text)
    except ValueError as error:
        raise UsageError(f"{name}={text!r}: {error}", remedy=f"set {name} to seconds or 30s / 10m") from None
    if value < 0 or (value == 0 and not zero_ok):
        raise UsageError(f"{name} must be positive, not {text!r}", remedy=f"set {name} to e.g. 30s")
    return value
