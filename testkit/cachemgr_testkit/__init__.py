"""Support for cachemgr's tests and benchmarks: one place for what both use.

podlib       real ``cachemgr run`` pods ("pods") against the stand-in server, and ``run_cli``.
mounts       real filesystems: JuiceFS and SeaweedFS volumes mounted N times, small tmpfs.
s3server     a real S3 server (SeaweedFS ``weed mini``) on loopback ports picked free.
scenarios    argvs and invariant checks shared by the run tests.
campaign     the fault campaign's watch on pods' lives and views, and its remote tier behind a proxy.
helm         a real Helm 4 (installed from a registry package) and the chart rendered by it.
kube         the chart's objects rendered by that Helm, and their containers run as real processes.
faketime_shim  put on PYTHONPATH beside libfaketime (podlib.skewed_env says why).

Installed (editable) by ``scripts/install .venv test``; tests and bench scripts import it as
``cachemgr_testkit.<module>``, never through ``sys.path`` edits.
"""
