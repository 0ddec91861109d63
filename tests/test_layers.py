"""The package's layers, checked from its imports (docs/development.md has the map).

cachemgr is grouped into subpackages that are layers: ``core`` (errors, units, logging,
processes, safe file access) under ``key`` (the cache key's inputs) under ``volume`` (the
on-volume layout and records) under ``ops`` (the operators' commands) under ``remote`` (the
S3 tier) under ``runtime`` (the pod's entrypoint) under ``cli``. A module imports only from
its own layer or lower ones, in any form (module level, inside a function, or for types
only), and no modules import each other in a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "cachemgr"
LAYERS = ("core", "key", "volume", "ops", "remote", "runtime", "cli")

pytestmark = pytest.mark.quick


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()


def _layer(module: str) -> int:
    parts = module.split(".")
    if module == "cachemgr":
        return -1  # the version only: anyone may read it
    if parts[1] == "__main__":
        return LAYERS.index("cli")
    return LAYERS.index(parts[1])


def _resolve(name: str) -> str:
    """The module an imported name lives in: ``cachemgr.core.safefs`` for ``from cachemgr.core import safefs``."""
    while name not in MODULES and "." in name:
        name = name.rpartition(".")[0]
    return name


def _imports(path: Path, *, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    body = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in body:
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {_resolve(name) for name in found if name.split(".")[0] == "cachemgr"}


def test_every_module_belongs_to_a_layer() -> None:
    strays = [m for m in MODULES if m.count(".") >= 1 and m.split(".")[1] not in (*LAYERS, "__main__")]
    assert strays == [], f"modules outside the layers {LAYERS}: {strays}"


def test_no_layer_imports_a_higher_one() -> None:
    upward = []
    for module, path in MODULES.items():
        for target in _imports(path, top_level_only=False):
            if _layer(target) > _layer(module):
                upward.append(f"{module} -> {target}")
    assert upward == [], "imports from a higher layer:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_of_any_kind() -> None:
    """No loop: not at module level, not inside a function (lazy), not for types only."""
    graph = {m: _imports(p, top_level_only=False) - {m} for m, p in MODULES.items()}
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            cycle = [*trail[trail.index(module) :], module]
            pytest.fail("import cycle: " + " -> ".join(cycle))
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, [*trail, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])


def test_package_init_files_hold_no_logic() -> None:
    for module, path in MODULES.items():
        if path.name != "__init__.py":
            continue
        body = ast.parse(path.read_text()).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        allowed = ["__version__"] if module == "cachemgr" else []
        names = [
            t.id
            for node in body
            if isinstance(node, ast.Assign)
            for t in node.targets
            if isinstance(t, ast.Name)
        ]
        assert names == allowed, f"{path} defines {names}, not {allowed}"
        assert len(body) == len(allowed), f"{path} holds more than {allowed or 'a docstring'}"


MAX_LINES = 500
# Generated tables, one line per item: tools/gen_vllm_flags.py's of vLLM's options, and
# tools/oracle/derive.py's of the defaults and ignored options the oracle found.
LONG_MODULES_ALLOWED = {
    "cachemgr.key.vllm_flags",
    "cachemgr.key.vllm_identity",
    "cachemgr.key.vllm_identity_0_11_2",
}


def test_no_module_is_over_500_lines() -> None:
    """One concept per module: a module past this has more than one, and splits along their seam."""
    long = {m: n for m, p in MODULES.items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    over = sorted(f"{m} ({n} lines)" for m, n in long.items() if m not in LONG_MODULES_ALLOWED)
    assert over == [], f"modules over {MAX_LINES} lines: {over}"
    assert "cachemgr.key.vllm_flags" in long, "the check counts lines (the generated table is long)"


def test_the_checks_see_the_imports() -> None:
    """The parser finds every form the rules speak of (a check that sees nothing passes anything)."""
    runner = _imports(MODULES["cachemgr.runtime.runner"], top_level_only=False)
    assert {"cachemgr.core.errors", "cachemgr.volume.store", "cachemgr.key.cachekey"} <= runner
    assert _layer("cachemgr.cli.main") > _layer("cachemgr.runtime.runner") > _layer("cachemgr.core.errors")
    assert _resolve("cachemgr.core.safefs") == "cachemgr.core.safefs"
    assert _resolve("cachemgr.volume.layout.CacheRoot") == "cachemgr.volume.layout"
