"""STAND-INS for the RBLN compiler and the ``vllm`` server. They are NOT the real tools.

There is no NPU, rebel-compiler or vllm-rbln where cachemgr is developed and tested, so these
small stdlib-only programs take their place in tests and in ``cachemgr demo``. They do nothing
useful on their own: they burn a little CPU, write deterministic bytes, and behave like the real
tools in every way that matters to a compile cache: where artifacts go, when they appear, what
keys them, what hits and what recompiles, when the server answers /health, how they fail (exit
codes, disk full, hangs) and how they react to signals. Every program says so on stderr first:
``STAND-IN ... (cachemgr_standin, not ...)``.

* :mod:`cachemgr_standin.compiler` -- ``python -m cachemgr_standin.compiler --output-dir DIR ...``,
  for rebel-compiler / optimum-rbln export: writes a compiled model directory.
* :mod:`cachemgr_standin.server` -- ``python -m cachemgr_standin.server serve MODEL ...``, for
  ``vllm serve`` with vllm-rbln 0.12: both model paths (optimum compiled directories under
  ``$VLLM_CACHE_ROOT/compiled_models`` and vLLM-model mega-cache bundles under
  ``$VLLM_CACHE_ROOT/rbln``), and an HTTP server that binds only once warm.
* :mod:`cachemgr_standin.shim` -- ``write_vllm_shim(bin_dir)``: a ``vllm`` executable that runs the
  stand-in server, so the literal argv ``vllm serve MODEL ...`` works with bin_dir on PATH.

Environment knobs (both programs; compiler flags override them):

* ``STANDIN_COMPILE_SECONDS`` (2.0), ``STANDIN_LOAD_SECONDS`` (0.1, server only),
  ``STANDIN_ARTIFACT_FILES`` (4), ``STANDIN_ARTIFACT_BYTES`` (1M; ``64k``/``1M``/``2G`` accepted).
* ``STANDIN_RECORD``: file to append JSON event lines to (``compile`` when a compile starts,
  ``compiled`` when it ends, ``load``, ``save``, ``save-failed``). ``STANDIN_START_RECORD``: a file
  the server appends its ``start`` event to as it starts: its parent's pid and ``spawned_boot``,
  when it was forked, in seconds of CLOCK_BOOTTIME (from /proc, which libfaketime does not skew).
* ``STANDIN_VLLM_VERSION`` (server only): the vLLM version the stand-in "has installed" (default
  :data:`VLLM_VERSION`); it enters the vLLM-model path's bundle signature, as ``vllm.__version__``
  enters vllm-rbln's. Change it alone to make the stand-in drift from what cachemgr was told.
* ``STANDIN_TRANSFORMERS_VERSION`` (server only): the transformers version it "has installed" (default
  :data:`TRANSFORMERS_VERSION`); the hashed ``hf_config`` carries it, as transformers' does.
* ``STANDIN_EXTRA_GRAPHS`` (server only, default 0): graphs the vLLM-model path needs beyond
  ``STANDIN_ARTIFACT_FILES``: on a hit it finds them missing from the bundle it loads, compiles them
  and re-saves the grown bundle at the same path, as vllm-rbln does when a newer SDK adds graphs.
* ``STANDIN_BUNDLE_STAMP=1`` (server only): every bundle save carries a fresh stamp, so the same
  graphs are saved as other bytes of the same size: a writer whose bundles are not byte-stable.
* ``STANDIN_NPU_NAME``: what the fake ``rebel.get_npu_name(0)`` answers (see ``pymods/``); unset,
  there is no device.
* Server faults: ``STANDIN_EXIT_BEFORE_HEALTHY=<code>`` (negative: die by that signal),
  ``STANDIN_QUOTA_EXCEEDED=1``, ``STANDIN_HANG=1``; ``STANDIN_SIGNAL_LOG``, ``STANDIN_EXIT_CODE``;
  ``STANDIN_EXIT_ON_LOAD=<code>`` (negative: a signal): after loading compiled artifacts it did not
  compile itself (a hit), die before ready with a traceback's last lines.
"""

# What the stand-in "has installed", declared the way an image without the real packages declares
# them to cachemgr (docs/design.md, the cache key: the server versions are read from package
# metadata, else these).
VLLM_VERSION = "0.30.0+cpu"  # vllm-rbln 0.12.0 pins vllm==0.30.0+cpu
VLLM_RBLN_VERSION = "0.12.0"
OPTIMUM_RBLN_VERSION = "0.12.0"
TRANSFORMERS_VERSION = "5.15.1"  # optimum-rbln 0.12.0 pins transformers==5.15.1
DECLARED_VERSIONS = {
    "CACHEMGR_VLLM_VERSION": VLLM_VERSION,
    "CACHEMGR_VLLM_RBLN_VERSION": VLLM_RBLN_VERSION,
    "CACHEMGR_OPTIMUM_RBLN_VERSION": OPTIMUM_RBLN_VERSION,
    "CACHEMGR_TRANSFORMERS_VERSION": TRANSFORMERS_VERSION,
}
