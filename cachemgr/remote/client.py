"""The S3 client (boto3, imported here and only here) and what its failures mean to an operator.

Every request is bounded: a connect and a read timeout from the configuration and two retries,
so an unreachable endpoint costs a pod seconds, not the default minutes. Failures become one
:class:`RemoteError` whose message says what was wrong (unreachable, credentials, bucket,
space) and what to do.
"""

from __future__ import annotations

import os
from typing import Any

from cachemgr.core.errors import CacheMgrError, ExitCode
from cachemgr.remote.config import ENV_ENDPOINT, ENV_URL, INSTALL, RemoteConfig, redact


class RemoteError(CacheMgrError, OSError):
    """The remote cannot be used now; a pod compiles locally instead (exit 74 from the CLI)."""

    reason = "remote"


class RemoteDamageError(RemoteError):
    """A remote entry that does not match its manifest or key: never published, never trusted."""

    reason = "remote-damaged"


class RemoteUntrustedError(RemoteDamageError):
    """A remote entry no trusted key signed as it is (cachemgr.volume.trust): never published here."""

    reason = "remote-untrusted"


_CREDENTIAL_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "AccessDenied",
    "InvalidToken",
    "ExpiredToken",
    "AuthorizationHeaderMalformed",
    "InvalidClientTokenId",
}


# What a store answers for one object it will not serve while it serves the bucket: SSE-C
# encrypted (AWS InvalidRequest, SeaweedFS InvalidArgument), archived by a lifecycle rule
# (InvalidObjectState), another account's or denied by policy (AccessDenied).
OBJECT_REFUSALS = frozenset({"AccessDenied", "InvalidObjectState", "InvalidRequest", "InvalidArgument"})


class RemoteFullError(RemoteError):
    """The store refused a write for space or quota: exit 73, as a full volume (never stops a pod)."""

    exit_code = ExitCode.DISK_FULL
    reason = "remote-full"


# Refusals for space or quota: S3's and MinIO's codes, Ceph RGW's QuotaExceeded (HTTP 403), and
# WebDAV's 507 Insufficient Storage that some gateways answer with an empty body.
_FULL_CODES = {"QuotaExceeded", "XMinioStorageFull", "InsufficientStorage", "EntityTooLarge", "StorageFull"}
REMOTE_FULL_REMEDY = (
    "free space in the bucket ('cachemgr prune --remote') or raise its quota, or unset CACHEMGR_REMOTE"
)


def make_client(config: RemoteConfig) -> Any:
    """A boto3 S3 client for ``config``: bounded timeouts, path-style addressing for custom endpoints."""
    try:
        import boto3  # the remote paths only: a local hit never imports boto3
        from botocore.config import Config
    except ImportError as error:
        raise RemoteError(
            f"remote {config.url} needs {error.name or 'boto3'}, which this install of cachemgr lacks",
            remedy=f"install the remote tier's client ({INSTALL}; the modelserver image has it), or unset {ENV_URL}",
            problem="not-installed",
        ) from None

    options = Config(
        connect_timeout=config.timeout,
        read_timeout=config.timeout,
        retries={"max_attempts": 2, "mode": "standard"},
        # Parallel transfers use up to 16 connections: as many pooled, or urllib3 warns and drops them.
        max_pool_connections=32,
        s3={"addressing_style": "path"} if config.endpoint else {},
    )
    session = boto3.session.Session()
    return session.client("s3", endpoint_url=config.endpoint, config=options)


def describe(error: BaseException, config: RemoteConfig, *, doing: str) -> RemoteError:
    """A boto3/botocore failure (or OSError) as one line: what was wrong and what to do. No
    credential's value reaches it, whatever botocore or the store said (:func:`redact`)."""
    said = _describe(error, config, doing=doing)
    what, remedy = redact(said.what, os.environ), redact(said.remedy, os.environ)
    if (what, remedy) == (said.what, said.remedy):
        return said
    return type(said)(what, remedy=remedy, **said.fields)


def _describe(error: BaseException, config: RemoteConfig, *, doing: str) -> RemoteError:  # noqa: PLR0911  # one return per kind of failure: a table
    where = f"{config.url}" + (f" at {config.endpoint}" if config.endpoint else "")
    if isinstance(error, RemoteError):  # first: said already, and botocore may not be installed
        return error
    if isinstance(error, CacheMgrError):  # the volume's own refusal (a planted link): said as it is
        return RemoteError(error.what, remedy=error.remedy, problem=error.reason)
    from botocore import exceptions as bx

    if isinstance(error, bx.NoCredentialsError | bx.PartialCredentialsError):
        return RemoteError(
            f"no credentials for remote {where} while {doing}",
            remedy="give the pod AWS credentials: a Secret with AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or a "
            "ServiceAccount with IRSA / workload identity",
            problem="credentials",
        )
    if isinstance(error, bx.ClientError):
        return _client_error(error, where=where, doing=doing)
    if isinstance(error, bx.ConnectTimeoutError | bx.ReadTimeoutError):
        return RemoteError(
            f"remote {where} did not answer within {config.timeout:g}s while {doing}",
            remedy="check the endpoint and the network path to it; CACHEMGR_REMOTE_TIMEOUT sets the limit",
            problem="timeout",
        )
    if isinstance(error, bx.EndpointConnectionError | bx.ConnectionError | bx.HTTPClientError):
        return RemoteError(
            f"remote {where} is unreachable while {doing} ({error})",
            remedy=f"check {ENV_ENDPOINT} (or the AWS region) and that the store is up and reachable from the pod",
            problem="unreachable",
        )
    if isinstance(error, TimeoutError):
        return RemoteError(
            f"remote {where}: {error}",
            remedy="CACHEMGR_REMOTE_BUDGET sets the time a pod spends on the remote before compiling",
            problem="budget",
        )
    return RemoteError(
        f"remote {where} failed while {doing}: {type(error).__name__}: {error}",
        remedy="check the remote's endpoint, bucket and credentials",
        problem="other",
    )


def _client_error(error: Any, *, where: str, doing: str) -> RemoteError:
    info = error.response.get("Error", {})
    code = str(info.get("Code", ""))
    status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    message = str(info.get("Message", "")) or code
    if code in _FULL_CODES or status == 507:  # before credentials: Ceph RGW says QuotaExceeded with a 403
        return RemoteFullError(
            f"remote is full or over quota: {where} refused {doing} ({code or status}: {message})",
            remedy=REMOTE_FULL_REMEDY,
            problem="full",
        )
    if code in _CREDENTIAL_CODES or status in {401, 403}:
        return RemoteError(
            f"remote {where} refused the credentials while {doing} ({code or status}: {message})",
            remedy="check the pod's AWS credentials (Secret or ServiceAccount role) and the bucket policy",
            problem="credentials",
        )
    if code == "NoSuchBucket":
        return RemoteError(
            f"remote bucket of {where} does not exist ({message})",
            remedy="create the bucket, or fix --remote / CACHEMGR_REMOTE",
            problem="bucket",
        )
    return RemoteError(
        f"remote {where} answered {code or status} while {doing} ({message})",
        remedy="check the remote's endpoint, bucket and credentials",
        problem=code or str(status),
    )
