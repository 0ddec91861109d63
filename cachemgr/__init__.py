"""cachemgr: compile once per cache key, reuse everywhere.

The library never imports :mod:`cachemgr.cli`.
"""

__version__ = "0.1.0"
