"""A download takes no more bytes of an object than the manifest lists for its file.

Whoever writes the bucket can put a 50 GiB object where the manifest lists 1 KiB: s3transfer
sizes a download by the object's HEAD and would fetch all of it into staging, filling the
volume before the hash check calls it damage. Two guards, each enough alone:

- :class:`SizeGuard` reads the size the store announces (a HEAD's ``Content-Length``, a GET's
  ``Content-Range`` total or ``Content-Length``) through botocore's ``after-call`` event, and
  refuses a larger object before its body is read;
- :class:`Capped`, the file object s3transfer writes into, refuses a byte past the manifest's
  size (a store that announces one size and sends more, or no size at all).

Both raise :class:`ObjectTooLargeError`: a ValueError, so neither botocore nor s3transfer retries it
(they retry OSErrors); the transfer turns it into RemoteDamageError.
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

_CONTEXT = "cachemgr_expected_size"


class ObjectTooLargeError(ValueError):
    """A remote object larger than its manifest entry."""

    def __init__(self, key: str, *, size: int | None, expected: int) -> None:
        name = repr(key.rsplit("/", 1)[-1])
        super().__init__(
            f"object {name} is {size} bytes, its manifest lists {expected}"
            if size is not None
            else f"object {name} runs past the {expected} bytes its manifest lists"
        )


class SizeGuard:
    """Held by a client: the manifest's size of each object key a download is about to fetch."""

    def __init__(self, client: Any) -> None:
        self._expected: dict[str, int] = {}
        events = client.meta.events
        for operation in ("HeadObject", "GetObject"):
            events.register(
                f"before-parameter-build.s3.{operation}", self._remember, unique_id=f"cm-size-{operation}"
            )
            events.register(f"after-call.s3.{operation}", self._check, unique_id=f"cm-check-{operation}")

    def expect(self, key: str, size: int) -> None:
        self._expected[key] = size

    def _remember(self, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        expected = self._expected.get(str(params.get("Key")))
        if expected is not None:
            context[_CONTEXT] = (str(params.get("Key")), expected)

    def _check(self, http_response: Any, parsed: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
        known = context.get(_CONTEXT)
        if known is None or getattr(http_response, "status_code", 500) >= 300:
            return  # not a file of a download, or an error botocore reports itself
        key, expected = known
        size = _announced(parsed)
        if size is not None and size > expected:
            raise ObjectTooLargeError(key, size=size, expected=expected)


def _announced(parsed: dict[str, Any]) -> int | None:
    """The object's whole size as the answer states it: a range's total, else its length."""
    ranged = str(parsed.get("ContentRange") or "")
    total = ranged.rpartition("/")[2]
    if total.isdigit():
        return int(total)
    length = parsed.get("ContentLength")
    return int(length) if isinstance(length, int) and not ranged else None


class Capped:
    """The staging file s3transfer writes (it seeks to each part's offset, then writes): no byte
    past ``size`` is written."""

    def __init__(self, handle: BinaryIO, *, size: int, key: str) -> None:
        self._handle = handle
        self._size = size
        self._key = key

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def write(self, data: bytes) -> int:
        if self._handle.tell() + len(data) > self._size:
            raise ObjectTooLargeError(self._key, size=None, expected=self._size)
        return self._handle.write(data)

    def close(self) -> None:
        self._handle.close()

    @property
    def closed(self) -> bool:
        return self._handle.closed
