"""Which weights are compiled in: a weight file's content identity, read cheaply enough for every start.

optimum-rbln compiles the weights into the model it saves (``from_pretrained`` reads every tensor
before the compile), so two directories with the same config and other weights of the same size
compile two different models; the server's own directory name does not tell them apart
(vllm-rbln ``dispatch.py`` 59-98: it hashes the model path string and a few settings). The key
must, and on every pod start, where hashing a 100 GiB model whole would take minutes.

So each weight file is identified by its content, cheaply:

- a Hugging Face snapshot's file is a link to ``blobs/<sha256>``: the hub names the blob by the
  hash of its content, so the link's target is the identity, exactly, for the cost of a readlink;
- any other file by its size and a sample of its bytes: its first 256 KiB (a safetensors header
  names every tensor with its dtype, shape and offsets, and lies there for all but the largest
  checkpoints) and 16 blocks of 4 KiB spread evenly over the rest. Other weights of the same
  layout (a fine-tune, another quantization calibration) differ in nearly every block, so the
  sample tells them apart; what it cannot see is an edit of a few bytes between the blocks,
  which no fine-tune makes. ``bench/bench_fingerprint.py`` measures it on a 100 GiB directory.

The model directory is the operator's mount, not the cache volume: its links are followed as the
server follows them (a snapshot is links into ``blobs/``).
"""

from __future__ import annotations

import os
import re
import stat

import xxhash

HEAD_BYTES = 256 * 1024
BLOCK_BYTES = 4096
BLOCKS = 16
_WHOLE_BELOW = HEAD_BYTES + BLOCKS * BLOCK_BYTES  # smaller files are read whole
_HUB_BLOB = re.compile(r"(?:^|/)blobs/([0-9a-f]{64})$")  # an LFS blob: named by the sha256 of its content
_READERS = 8  # network filesystems answer a random read in milliseconds: read files in parallel


def content_ids(paths: dict[str, str]) -> dict[str, str]:
    """``{relative name: content id}`` for ``{relative name: path}``; unreadable files raise OSError."""
    if len(paths) <= 1:
        return {name: content_id(path) for name, path in paths.items()}
    from concurrent.futures import ThreadPoolExecutor  # a sharded checkpoint only: a few ms of import

    with ThreadPoolExecutor(max_workers=min(_READERS, len(paths))) as pool:
        ids = pool.map(content_id, paths.values())
        return dict(zip(paths, ids, strict=True))


def content_id(path: str) -> str:
    """``sha256:<hex>`` for a hub blob, else ``xxh3:<size>:<hex>`` of the file's size and sampled bytes."""
    try:
        target = os.readlink(path)
    except OSError:
        target = None
    if target is not None:
        blob = _HUB_BLOB.search(target)
        if blob:
            return f"sha256:{blob.group(1)}"
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a regular file")
        return f"xxh3:{info.st_size}:{_sampled(fd, info.st_size)}"
    finally:
        os.close(fd)


def _sampled(fd: int, size: int) -> str:
    digest = xxhash.xxh3_128()
    if size <= _WHOLE_BELOW:
        digest.update(os.pread(fd, size, 0))
        return digest.hexdigest()
    digest.update(os.pread(fd, HEAD_BYTES, 0))
    rest = size - HEAD_BYTES - BLOCK_BYTES
    for i in range(BLOCKS):
        digest.update(os.pread(fd, BLOCK_BYTES, HEAD_BYTES + rest * i // (BLOCKS - 1)))
    return digest.hexdigest()
