"""The remote tier: compiled entries on S3-compatible object storage, so a key compiles once per fleet.

A layer of its own: the runner calls it in two places (:mod:`cachemgr.remote.hooks`), the CLI's
``push``/``pull``/``ls --remote``/``prune --remote`` in :mod:`cachemgr.cli.cmd_remote`. Only
:mod:`cachemgr.remote.config` is imported before the remote is used: boto3 (about 0.3 s to
import) is loaded on the paths that talk to the bucket, never on a local hit.
"""
