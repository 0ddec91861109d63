"""Each rule the runner shares with the CLI and the volume has one definition (issue 14).

The lease's default duration, an error's exit code, the failure reasons /metrics exports and the
strategies a key may name: every user reads the one definition, so changing it changes them all.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import typing
from pathlib import Path

import pytest

from cachemgr.cli.cmd_run import run_options
from cachemgr.cli.errors import exit_code_for
from cachemgr.cli.main import _COMMANDS, _HANDLERS, build_parser
from cachemgr.core import errors
from cachemgr.core.errors import CacheMgrError, Interrupted, MissError, StateDirInUseError, WaitTimeoutError
from cachemgr.key.cachekey import Strategy
from cachemgr.runtime.failures import count_failed_run
from cachemgr.runtime.metrics import FAILURE_REASONS, Metrics
from cachemgr.runtime.options import RunOptions
from cachemgr.runtime.state import StateWriter, read_state
from cachemgr.runtime.strategies import STRATEGIES
from cachemgr.volume.lease import KeyLease
from cachemgr.volume.lease_defaults import DEFAULT_DURATION


def test_the_lease_default_is_one_constant_that_the_cli_the_options_and_the_lease_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    args = build_parser().parse_args(["run", "--cache-root", "/cache"])
    assert args.lease_duration == DEFAULT_DURATION
    assert run_options(args, warm=False).lease_duration == DEFAULT_DURATION
    assert RunOptions(cache_root=Path("/x"), state_dir=Path("/y")).lease_duration == DEFAULT_DURATION
    assert inspect.signature(KeyLease).parameters["duration"].default == DEFAULT_DURATION
    # and they follow it: a changed default reaches the parser built after the change
    monkeypatch.setattr("cachemgr.cli.options.DEFAULT_LEASE_DURATION", 45.0)
    assert build_parser().parse_args(["run"]).lease_duration == 45.0


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.quick
def test_a_command_built_alone_is_the_command_of_the_whole_parser() -> None:
    """`cachemgr run` builds only run's parser (the hit path); each command built alone must take
    the same arguments and print the same help as in the whole parser `cachemgr --help` builds."""
    assert set(_COMMANDS) == set(_HANDLERS), "every command has arguments and a handler"
    whole = _subcommands(build_parser())
    assert list(whole) == list(_COMMANDS)
    for name, parser in whole.items():
        alone = _subcommands(build_parser(name))
        assert list(alone) == [name]
        assert alone[name].format_help() == parser.format_help(), name


def _error_classes() -> list[type[CacheMgrError]]:
    return [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, CacheMgrError)]


def test_every_error_class_a_run_can_fail_with_is_exported_as_a_failure_reason() -> None:
    reasons = {c.reason for c in _error_classes() if c not in (CacheMgrError, StateDirInUseError)}
    assert set(FAILURE_REASONS) == reasons
    assert len(FAILURE_REASONS) == len(reasons), "each reason once"


def test_the_cli_and_the_state_record_report_the_same_exit_code(tmp_path: Path) -> None:
    for error in (Interrupted(2), MissError("m", remedy="r"), WaitTimeoutError("w", remedy="r")):
        state = StateWriter(tmp_path, stall_timeout=None)
        count_failed_run(error, metrics=Metrics(), state=state)
        assert read_state(tmp_path).detail["exit_code"] == exit_code_for(error) == error.code
    assert Interrupted(2).code == 130
    assert MissError("m", remedy="r").code == 69


def test_every_strategy_a_key_may_name_has_a_strategy_object() -> None:
    assert set(STRATEGIES) == set(typing.get_args(Strategy))
    assert all(cls.name == name for name, cls in STRATEGIES.items())


# Modules that parse JSON with json.loads themselves, and why what they parse is not the volume's
# or the bucket's (everything else goes through cachemgr.core.jsonread: issue 33).
_JSON_OF_OUR_OWN = {
    "cachemgr/core/jsonread.py": "the one reader itself",
    "cachemgr/key/vllm_values.py": "a flag's value in the pod's own argv (bounded by MAX_DEPTH there)",
    "cachemgr/key/vllm_rbln.py": "VLLM_MODEL_REDIRECT_PATH, a file of the pod's own configuration",
    "cachemgr/runtime/metrics.py": "the pod-local state dir, written by this pod only",
    "cachemgr/runtime/state.py": "the pod-local state record, written by this pod only",
    "cachemgr/cli/documents.py": "its own output, round-tripped to plain JSON types for -o yaml",
    "cachemgr/cli/demo.py": "the state and logs of the demo's own pods",
    "cachemgr/remote/worker.py": "the request line its parent pod writes on its stdin",
    "cachemgr/remote/bounded.py": "the lines its own transfer child writes (from records already read bounded)",
}


def _json_parses(tree: ast.AST) -> list[int]:
    """Lines calling json.loads / json.load / json.JSONDecoder, or importing them by name."""
    found = []
    for node in ast.walk(tree):
        called = (
            isinstance(node, ast.Attribute)
            and node.attr in {"loads", "load", "JSONDecoder", "raw_decode"}
            and isinstance(node.value, ast.Name)
            and node.value.id == "json"
        )
        imported = (
            isinstance(node, ast.ImportFrom)
            and node.module == "json"
            and any(alias.name in {"loads", "load", "JSONDecoder"} for alias in node.names)
        )
        if called or imported:
            found.append(getattr(node, "lineno", 0))
    return found


@pytest.mark.quick
def test_no_module_parses_json_from_the_volume_or_the_bucket_but_through_the_one_reader() -> None:
    """Everything read from the volume or the bucket is parsed by cachemgr.core.jsonread (bounded
    size, depth and count; damage a ValueError): a bare json.loads of a record nested 200,000 deep
    made pods, the builder and the operator's commands exit 70. A module that must parse JSON of its
    own is listed above with the reason; a new one fails here until it uses the reader or is listed."""
    package = Path(__file__).resolve().parent.parent / "cachemgr"
    parsing = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent).as_posix()
        lines = _json_parses(ast.parse(path.read_text(encoding="utf-8")))
        if lines:
            parsing[rel] = lines
    unlisted = {rel: lines for rel, lines in parsing.items() if rel not in _JSON_OF_OUR_OWN}
    assert unlisted == {}, f"json.loads outside cachemgr.core.jsonread: {unlisted}"
    stale = sorted(set(_JSON_OF_OUR_OWN) - set(parsing))
    assert stale == [], f"listed but no longer parsing JSON themselves: {stale}"
