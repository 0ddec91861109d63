"""Every release as data (issue 39): one manifest, generated rules, rules per model path.

tools/releases/manifest.toml names each release by hand, and nothing else does: the oracle's
environment, corpus, identity and derive tools, testkit and the tests read it, and
tools/gen_rules.py writes each release's rules from it (``--check`` here). A release whose wheels
differ from a checked one's in version strings alone is keyed by that one's rules; a model path the
oracle did not check is keyed strictly by itself; a path whose artifacts cachemgr cannot hold is
said plainly (``run`` starts the server without the cache, ``warm`` refuses it: exit 78).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cachemgr_testkit import manifest, realserver
from cachemgr_testkit.podlib import cluster, free_port, npu_node, run_cli
from cachemgr_testkit.scenarios import KEY_ENV, MODEL, SERVE_ARGV

from cachemgr.key import releases
from cachemgr.key.cachekey import KeyRequest, compute_key

REPO = Path(__file__).resolve().parent.parent
# The model path as each kind of release picks it: vllm-rbln's --model-impl (0.12), the variable (0.11)
PATH_ARGS = {
    "vllm": (["--model-impl", "vllm"], {"VLLM_RBLN_USE_VLLM_MODEL": "1"}),
    "optimum": (["--model-impl", "optimum"], {"VLLM_RBLN_USE_VLLM_MODEL": "0"}),
}


def image(release: str) -> dict[str, str]:
    """What an image of this release of the manifest declares (its packages' metadata)."""
    entry = manifest.release(release)
    return {
        "CACHEMGR_VLLM_VERSION": entry.vllm,
        "CACHEMGR_VLLM_RBLN_VERSION": release,
        "CACHEMGR_OPTIMUM_RBLN_VERSION": entry.optimum_rbln,
        "CACHEMGR_TRANSFORMERS_VERSION": entry.transformers,
    }


def key(release: str, path: str, env: dict[str, str] | None = None) -> Any:
    flags, variables = PATH_ARGS[path]
    rules = releases.named(release)
    argv = [*SERVE_ARGV, *flags] if rules.model_impl == "flag_then_env" else SERVE_ARGV
    environ = {**KEY_ENV, **image(release), **variables, **(env or {})}
    return compute_key(KeyRequest(argv=argv, role="prefill", environ=environ))


def test_the_rules_are_what_the_generator_writes() -> None:
    """cachemgr/key/rules_*.py and rules_index.py: tools/gen_rules.py's reading of the manifest, the
    facts, the oracle tables and the overrides (it also checks derive.py's output)."""
    done = subprocess.run(
        [sys.executable, str(REPO / "tools" / "gen_rules.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.quick
def test_every_release_of_the_manifest_has_rules_and_nothing_else_does() -> None:
    known = [r.versions["vllm_rbln"] for r in releases.KNOWN]
    assert known == list(manifest.names())
    for release in releases.KNOWN:
        assert dict(release.versions) == manifest.release(release.versions["vllm_rbln"]).versions


# Where releases used to be named by hand (issue 39: ~12 places): these read the manifest now, and
# hold no release's version in their code.
_READERS = [
    "tools/oracle/env.sh",
    "tools/oracle/corpus.py",
    "tools/oracle/identity.py",
    "tools/oracle/derive.py",
    "tools/gen_rules.py",
    "testkit/cachemgr_testkit/oracle.py",
    "testkit/cachemgr_testkit/oracle_keys.py",
    "testkit/cachemgr_testkit/manifest.py",
    "tests/test_oracle.py",
    "tests/test_layers.py",
    "cachemgr/key/releases.py",
    "cachemgr/key/release_model.py",
]


def _code_strings(path: Path) -> list[str]:
    """The string constants of a Python file's code (not its docstrings or comments); a shell
    script's lines less its comments."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [line.split("#", 1)[0] for line in text.splitlines()]
    tree = ast.parse(text)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    # the corpus's other images name compiler versions, not releases (tools/oracle/corpus.py _IMAGES*)
    images = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.AnnAssign) and "IMAGES" in ast.unparse(node.target)
        for sub in ast.walk(node)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
        and id(node) not in images
    ]


@pytest.mark.quick
def test_no_other_place_names_a_release() -> None:
    """Adding a release names it in the manifest (and its overrides) only: the places that listed
    the releases by hand hold none of their versions in their code."""
    versions = {v for name in manifest.names() for v in (name, *manifest.release(name).versions.values())}
    versions |= {re.sub(r"\W", "_", v) for v in set(versions)}
    pattern = re.compile(
        r"(?<![\w.])("
        + "|".join(re.escape(v) for v in sorted(versions, key=len, reverse=True))
        + r")(?![\w.])"
    )
    found = {
        f"{name}: {match.group(1)!r} in {text[:60]!r}"
        for name in _READERS
        for text in _code_strings(REPO / name)
        for match in pattern.finditer(text)
    }
    assert found == set()
    assert pattern.search('"0.12.0"'), "the check finds a version where one is written"


@pytest.mark.quick
def test_a_release_whose_wheels_differ_in_version_strings_only_is_keyed_by_its_codes_rules() -> None:
    """vllm-rbln 0.11.2.post1 differs from 0.11.2 in _version.py alone (its RECORD, kept in its facts):
    it was keyed strictly, like any release not in the table; it takes 0.11.2's rules now."""
    post = key("0.11.2.post1", "optimum")
    assert post.inputs["rules"] == "vllm-rbln 0.11.2.post1"
    assert not any("strict" in note for note in post.notes), post.notes
    assert "0.11.2" in post.sources["rules"]
    base = key("0.11.2", "optimum")
    for name in ("serving", "env", "model_impl"):
        assert post.inputs[name] == base.inputs[name], name
    # the RECORD the verdict rests on: exactly one file of the code differs, the version module
    facts = json.loads((REPO / "tests" / "data" / "rbln_facts" / "vllm-rbln-0.11.2.post1.json").read_text())
    assert facts["differs"] == {"vllm_rbln/_version.py": "version strings only"}


@pytest.mark.quick
def test_a_path_the_oracle_did_not_check_is_strict_by_itself() -> None:
    """vllm-rbln 0.11.1: the oracle checks its optimum path (its vLLM-model path has no bundle to
    identify); a key on the other path says it is strict and why."""
    rules = releases.named("0.11.1")
    assert "vllm" not in rules.checked
    vllm_path = key("0.11.1", "vllm")
    assert vllm_path.inputs["rules"] == "strict"
    assert any("vLLM-model path was not checked" in note for note in vllm_path.notes), vllm_path.notes


@pytest.mark.quick
@pytest.mark.parametrize("release", manifest.names())
@pytest.mark.parametrize("path", ["vllm", "optimum"])
def test_no_secret_reaches_a_key_under_any_releases_rules(release: str, path: str) -> None:
    secrets = {
        "VLLM_API_KEY": "sk-planted-1",
        "HF_TOKEN": "hf_planted_2",
        "AWS_SECRET_ACCESS_KEY": "planted/3",
    }
    found = key(release, path, env={**secrets, "VLLM_RBLN_PLANTED_TOKEN": "planted-4"})
    shown = json.dumps(
        {"inputs": found.inputs, "details": found.details, "sources": found.sources}, default=str
    )
    for value in [*secrets.values(), "planted-4"]:
        assert value not in shown, (release, path, value)


@pytest.mark.quick
def test_the_vllm_model_path_of_a_release_whose_compiler_caches_it_cannot_be_cached() -> None:
    """0.11.1's vLLM-model path leaves no mega-cache bundle: cachemgr can hold nothing of it."""
    found = key("0.11.1", "vllm")
    assert found.details["layout_uncacheable"], found.details
    assert "the RBLN compiler caches its graphs itself" in found.details["uncacheable"][0]
    assert not key("0.11.1", "optimum").details.get("layout_uncacheable")
    assert not key("0.12.0", "vllm").details.get("layout_uncacheable")


@pytest.mark.quick
def test_the_optimum_path_of_a_release_that_compiles_a_local_model_in_place_cannot_be_cached(
    tmp_path: Path,
) -> None:
    """vllm-rbln 0.11.2 compiles a model read from a local path in place and saves nothing (seen with
    its real server, tests/test_realserver_releases.py): was keyed, leased and waited for as if
    cached, every pod compiling in turn. A hub id online is cached; offline vLLM reads it from its
    snapshot directory, so it is not."""
    model = tmp_path / "tiny"
    model.mkdir()
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}')

    def local(release: str, path: str, env: dict[str, str] | None = None) -> Any:
        flags, variables = PATH_ARGS[path]
        rules = releases.named(release)
        argv = [*SERVE_ARGV, *flags] if rules.model_impl == "flag_then_env" else SERVE_ARGV
        argv = [str(model) if a == "org/model" else a for a in argv]
        environ = {**KEY_ENV, **image(release), **variables, **(env or {})}
        return compute_key(KeyRequest(argv=argv, role="prefill", environ=environ))

    found = local("0.11.2", "optimum")
    assert "compiles a model read from a local path in place" in found.details["layout_uncacheable"][0]
    assert key("0.11.2.post1", "optimum", {"HF_HUB_OFFLINE": "1"}).details.get("layout_uncacheable")
    assert not key("0.11.2", "optimum").details.get("layout_uncacheable"), "a hub id online is cached"
    assert not local("0.11.2", "vllm").details.get("layout_uncacheable"), "the bundle is cached"
    assert not local("0.12.0", "optimum").details.get("layout_uncacheable")


def test_warm_refuses_and_run_passes_through_what_cannot_be_cached(tmp_path: Path) -> None:
    """Was: run compiled and never published, warm ended in a CompileError (exit 70)."""
    root = tmp_path / "volume"
    root.mkdir()
    env = {**image("0.11.1"), "VLLM_RBLN_USE_VLLM_MODEL": "1", **npu_node(tmp_path)}
    with cluster(tmp_path / "pods", STANDIN_COMPILE_SECONDS="0.1") as pods:
        argv = ["vllm", "serve", MODEL, "--port", str(free_port())]
        job = pods.start("warm", argv, cache_root=root, command="warm", env=env)
        assert job.wait_exit() == 78, job.tail()
        assert "warm cannot cache key" in job.tail()
        assert "the RBLN compiler caches its graphs itself" in job.tail()
        pod = pods.start("run", argv, cache_root=root, env=env)
        pod.wait_phase("serving")
        events = [e["event"] for e in pod.log_events()]
        assert "not_cacheable" in events, events
        assert "compiling" not in {e.get("phase") for e in pod.log_events()}
        assert not any(root.rglob("manifest.json")), "nothing published"
        pod.signal(15)
        assert pod.wait_exit() == 0, pod.tail()
    done = run_cli("key", "--", *argv, env={**KEY_ENV, **env, "CACHEMGR_ROLE": "prefill"})
    assert done.returncode == 0, done.stderr
    assert "the RBLN compiler caches its graphs itself" in done.stdout, done.stdout


@pytest.mark.quick
def test_what_is_loadable_and_what_drifted_follow_the_releases_layouts(tmp_path: Path) -> None:
    """runtime/loadable.py and volume/drift.py took both layouts for every release; they take the
    key's release's layouts for its model paths now."""
    from cachemgr.runtime.loadable import why_not_loadable
    from cachemgr.volume import drift

    bundle = tmp_path / "rbln" / "m-1" / "sig" / "rank0" / "mega_cache.bin"
    bundle.parent.mkdir(parents=True)
    bundle.write_bytes(b"graphs")
    assert why_not_loadable(tmp_path, strategy="vllm") is None
    assert why_not_loadable(tmp_path, strategy="vllm", layouts=("bundle",)) is None
    why = why_not_loadable(tmp_path, strategy="vllm", layouts=("optimum_dir",))
    assert why is not None
    assert "compiled_models" in why
    assert "mega_cache.bin" not in why
    rel = "rbln/m-1/sig/rank0/mega_cache.bin"
    assert drift._is_compiled(rel, drift.LAYOUTS)
    assert not drift._is_compiled(rel, ("optimum_dir",))
    assert not drift._is_compiled("compiled_models/x/rbln_config.json", ("bundle",))
    # the key says which: 0.11.1's optimum path, 0.12.0's two paths
    assert key("0.11.1", "optimum").details["layouts"] == ["optimum_dir"]
    assert key("0.12.0", "vllm").details["layouts"] == ["bundle"]


@pytest.mark.quick
def test_a_release_without_an_oracle_table_is_written_strict_on_every_path() -> None:
    """Adding a release needed a placeholder module first (the rules imported what only the oracle
    produces); the generator writes its rules from the facts alone, strict on every path."""
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import gen_rules
    finally:
        sys.path.remove(str(REPO / "tools"))
    text = gen_rules.render_release(manifest.release("0.11.1"), gen_rules.facts_of("0.11.1"), has_table=False)
    assert "vllm_identity" not in text, "nothing the oracle makes is imported"
    scope: dict[str, Any] = {}
    exec(compile(text, "rules_without_a_table.py", "exec"), scope)
    rules = scope["RELEASE"]
    assert rules.checked == frozenset()
    for paths in ({"vllm"}, {"optimum"}):
        assert rules.on_paths(frozenset(paths)).strict
    assert rules.env["VLLM_RBLN_AUTO_PORT"].default is False, "the facts are the release's own"


@pytest.mark.quick
@pytest.mark.parametrize("release", ["0.11.1", "0.11.2.post1"])
def test_the_added_releases_are_keyed_by_checked_rules(release: str) -> None:
    """vllm-rbln 0.11.1 (its optimum path checked by the oracle) and 0.11.2.post1 (0.11.2's code)."""
    found = key(release, "optimum")
    assert found.inputs["rules"] == f"vllm-rbln {release}"
    assert not any("strict" in note for note in found.notes), found.notes
    assert "optimum" in releases.named(release).checked


@pytest.mark.quick
@pytest.mark.parametrize("release", realserver.TIER)
@pytest.mark.parametrize("path", ["vllm", "optimum"])
def test_the_real_server_tiers_pods_are_keyed_by_their_releases_checked_rules(
    release: str, path: str, tmp_path: Path
) -> None:
    """The pods of tests/test_realserver.py declare their release's versions as its image would: the
    key is that release's rules, never the strict key of a release cachemgr does not know."""
    pod = realserver.pod_env(tmp_path, release, path)
    del pod["CACHEMGR_RBLN_DEV_DIR"]  # no device query (a process): CACHEMGR_NPU_TYPE names the NPU
    environ = {**KEY_ENV, **pod}
    server = realserver.argv(Path("org/tiny-llama"), 8000, path, release=release)  # a hub id: no weights read
    cache_key = compute_key(KeyRequest(argv=server, role="prefill", environ=environ))
    assert cache_key.details["release"] == releases.named(release).name
    assert cache_key.details["model_impl"] == path
