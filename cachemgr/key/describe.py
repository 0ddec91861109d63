"""What ``key`` and ``explain`` say about how a key was made: exactly what is keyed and what is not."""

from __future__ import annotations

from cachemgr.key.cachekey import CacheKey


def keyed_pairs(key: CacheKey) -> list[tuple[str, str]]:
    """(label, text) lines: the rules, the flags left out, at their default, or keyed as given."""
    pairs: list[tuple[str, str]] = []
    rules = key.sources.get("rules")
    if rules:
        pairs.append(("rules", rules))
    if key.dropped:
        pairs.append(("runtime-only", " ".join("--" + flag for flag in key.dropped) + " (not in the key)"))
    if key.defaulted:
        pairs.append(
            ("at default", ", ".join("--" + flag for flag in key.defaulted) + " (keyed as if not given)")
        )
    unknown = key.inputs.get("unknown_flags")
    if unknown:
        flags = ", ".join("--" + flag for flag in key.server.unknown)
        pairs.append(("keyed as given", f"{' '.join(unknown)} (vLLM 0.30 does not know {flags})"))
    pairs += [("cannot cache", reason) for reason in key.details.get("uncacheable", ())]
    return pairs
