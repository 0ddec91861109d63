"""Help everywhere, one form per kind of value, completion from the parser (issue 24 items 13, 14).

Generic over the parser: a command or option added later (by anyone) is held to the same rules,
so these tests name no fixed list of commands or options.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator

import pytest

from cachemgr.cli.main import build_parser
from cachemgr.cli.options import DURATION, SIZE, duration, size

# What a duration's or a size's option is called, whoever adds one: held to the one form.
_DURATION_NAMES = (
    "_timeout",
    "_duration",
    "_interval",
    "_seconds",
    "_for",
    "_heartbeat",
    "_confirm",
    "_after",
    "_budget",
)
_SIZE_NAMES = ("_size", "_bytes")


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction | argparse._VersionAction | argparse._SubParsersAction):
            continue
        yield action


COMMANDS = _commands()


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_opens_with_its_purpose_and_ends_with_examples(name: str) -> None:
    parser = COMMANDS[name]
    description = parser.description or ""
    first = description.split("\n", 1)[0]
    assert first[:1].isupper(), f"{name}: the help opens with what it is for: {first!r}"
    assert len(first) >= 20, f"{name}: say what it is for, not only its name: {first!r}"
    assert not first.lower().startswith("usage"), name
    epilog = (parser.epilog or "").splitlines()
    assert epilog, f"{name}: the help ends with examples"
    assert epilog[0] == "examples:", f"{name}: the help ends with examples"
    examples = [line.strip() for line in epilog[1:] if line.strip()]
    assert 2 <= len(examples) <= 3, (name, examples)
    assert all(f"cachemgr {name}" in line for line in examples), (name, examples)
    text = re.sub(r" \\\n +", " ", parser.format_help())  # an example continued after " \\"
    assert text.rstrip().endswith(examples[-1]), f"{name}: examples come last"


@pytest.mark.quick
@pytest.mark.parametrize("name", ["", *sorted(COMMANDS)])
def test_every_help_fits_80_columns_and_its_examples_copy_whole(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 40: at COLUMNS=80 every --help (18 of 18) had lines up to 129 columns: descriptions
    written at 95, examples of 129, and a flag cut at its hyphen ("stand-" / "in"). Each line
    fits; an example continues after " \\" and, joined as the shell joins it, is the command."""
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    shown = (COMMANDS[name] if name else parser).format_help()
    too_wide = [line for line in shown.splitlines() if len(line) > 80]
    assert too_wide == [], f"cachemgr {name} --help at COLUMNS=80"
    joined = re.sub(r" \\\n +", " ", shown)
    epilog = (COMMANDS[name] if name else parser).epilog or ""
    for example in [line.strip() for line in epilog.splitlines()[1:] if line.strip()]:
        assert f"  {example}\n" in joined + "\n", f"{example!r} does not copy whole"
    hyphenated = {w.strip(".,;:()[]'") for w in shown.split() if re.fullmatch(r"[\w(\[']*-", w)}
    assert hyphenated == set(), f"a word cut at its hyphen: {hyphenated}"


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_has_a_help_text(name: str) -> None:
    missing = [
        a.option_strings or [a.dest]
        for a in _options(COMMANDS[name])
        if not a.help or a.help == argparse.SUPPRESS
    ]
    assert missing == [], f"{name}: options without a help text: {missing}"


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_durations_and_sizes_have_one_form_everywhere(name: str) -> None:
    for action in _options(COMMANDS[name]):
        flag = (action.option_strings or [action.dest])[-1]
        assert action.metavar != "SECONDS", f"{name} {flag}: durations are DURATION everywhere"
        if action.dest.endswith(_DURATION_NAMES) or action.type is duration or action.metavar == DURATION:
            assert action.type is duration, f"{name} {flag}: a duration, parsed as one"
            assert action.metavar == DURATION, f"{name} {flag}: a duration, shown as one"
            for text, seconds in (("90", 90.0), ("90s", 90.0), ("1m30s", 90.0), ("1.5", 1.5)):
                assert action.type(text) == seconds, (name, flag, text)
            with pytest.raises(argparse.ArgumentTypeError):
                action.type("soon")
            assert "plain number is seconds" in (action.help or ""), f"{name} {flag}: say so"
        if action.dest.endswith(_SIZE_NAMES) or action.type is size or action.metavar == SIZE:
            assert action.type is size, f"{name} {flag}: a size, parsed as one"
            assert action.metavar == SIZE, f"{name} {flag}: a size, shown as one"
            assert action.type("150Gi") == 150 << 30


@pytest.mark.quick
def test_the_stable_seconds_contract_still_holds() -> None:
    """``--lease-duration SECONDS`` / ``--wait-timeout SECONDS`` (docs/design.md): a number is seconds."""
    args = build_parser().parse_args(["run", "--lease-duration", "45", "--wait-timeout", "600"])
    assert (args.lease_duration, args.wait_timeout) == (45.0, 600.0)
    args = build_parser().parse_args(["run", "--lease-duration", "1m", "--stall-timeout", "90"])
    assert (args.lease_duration, args.stall_timeout) == (60.0, 90.0)


@pytest.mark.quick
def test_prune_names_what_goes_apart_from_this_images_npu() -> None:
    prune = COMMANDS["prune"]
    flags = {s: a for a in _options(prune) for s in a.option_strings}
    assert "--for-npu" in flags, "what to remove"
    assert "--npu-type" in flags, "this image's NPU"
    assert "deprecated" in (flags["--npu"].help or ""), "the old spelling works, and says so"
    args = build_parser().parse_args(["prune", "--npu", "RBLN-CA12", "--for-npu", "RBLN-CA02"])
    assert (args.npu, args.for_npu) == (["RBLN-CA12"], ["RBLN-CA02"])


# --- completion -----------------------------------------------------------------------------------------


def _completion(shell: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "completion", shell],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return done.stdout


def test_bash_completion_is_generated_from_the_parser_and_knows_every_option() -> None:
    script = _completion("bash")
    for name, parser in COMMANDS.items():
        assert name in script
        for action in _options(parser):
            for flag in action.option_strings:
                assert flag in script, (name, flag)
    checked = subprocess.run(["bash", "-n"], input=script, text=True, capture_output=True, check=False)
    assert checked.returncode == 0, checked.stderr
    # Sourced, it completes: the commands after `cachemgr `, the options of one.
    probe = f"""{script}
COMP_WORDS=(cachemgr pr); COMP_CWORD=1; _shtab_cachemgr; printf '%s\\n' "${{COMPREPLY[@]}}"
COMP_WORDS=(cachemgr prune --for); COMP_CWORD=2; _shtab_cachemgr; printf '%s\\n' "${{COMPREPLY[@]}}"
"""
    shown = subprocess.run(["bash", "-c", probe], text=True, capture_output=True, check=False, timeout=60)
    assert {"prune", "probe"} <= set(shown.stdout.split()), shown.stdout + shown.stderr
    assert "--for-npu" in shown.stdout.split(), shown.stdout


def test_zsh_completion_is_generated_too() -> None:
    script = _completion("zsh")
    assert script.startswith("#compdef cachemgr")
    assert all(name in script for name in COMMANDS)
    if shutil.which("zsh"):
        checked = subprocess.run(["zsh", "-n"], input=script, text=True, capture_output=True, check=False)
        assert checked.returncode == 0, checked.stderr


def test_only_the_completion_command_imports_shtab() -> None:
    code = (
        "import sys\n"
        "from cachemgr.cli.main import build_parser, main\n"
        "build_parser()\n"
        "main(['ls', '--cache-root', '/nonexistent-volume'])\n"
        "main(['probe', 'startup', '--state-dir', '/nonexistent-state'])\n"
        "assert 'shtab' not in sys.modules, 'shtab on a path that does not need it'\n"
        "assert 'yaml' not in sys.modules, 'PyYAML is for -o yaml (and --config) only'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr


def test_a_pod_start_parses_its_arguments_without_shutil() -> None:
    """argparse's formatter imports shutil (with bz2, lzma, fnmatch: 2 ms) to ask the terminal's
    width, once for every option a parser adds: on every ``cachemgr run``, the hit path."""
    code = (
        "import sys\n"
        "from cachemgr.cli.main import parse\n"
        "parse(['run', '--verify', 'fast', '--prefetch', 'off'])\n"
        "print(' '.join(m for m in ('shutil', 'bz2', 'lzma') if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"parsing run's arguments imported {done.stdout.strip()}"


@pytest.mark.parametrize("columns", [50, 140])
def test_help_is_as_wide_as_columns_says(columns: int) -> None:
    """The width comes from $COLUMNS (else the terminal, else 80), as with argparse's own formatter."""
    env = {**_clean_env(), "COLUMNS": str(columns)}
    shown = subprocess.run(
        [sys.executable, "-m", "cachemgr", "run", "--help"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    # The options' help is wrapped; the description and examples are shown as written, and a usage
    # line holds a whole [--option VALUE].
    lines = shown.stdout.splitlines()
    options = [
        line for line in lines if line.startswith("  ") and "cachemgr " not in line and "[" not in line
    ]
    # A word longer than the room (CACHEMGR_PROGRESS_INTERVAL; at 50 columns) stays whole on its line.
    widest = max(len(line) for line in options if len(line.split()) > 1)
    assert columns - 12 <= widest <= columns - 2, f"help {widest} wide with COLUMNS={columns}"


def _clean_env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "COLUMNS"}


@pytest.mark.quick
@pytest.mark.parametrize(
    "command",
    [
        "cachemgr run --status-port 9090 -- vllm serve MiniMaxAI/MiniMax-M2.7 --tensor-parallel-size 8 --port 8000",
        "cachemgr ls -o json | jq '.items[] | select(.kind == \"entry\") | .short, .model, .status, .size_bytes'",
        'cachemgr stats -o jsonpath="{.volume.hits} hits, {.volume.waits} waits, {.volume.compiles} compiles x"',
        "cachemgr show 661096f8 --cache-root /var/cache/a\\ volume\\ with\\ spaces/and/a/long/path/behind/it/x",
        "cachemgr pull s3://" + "b" * 90 + " --budget 10m",
    ],
)
def test_a_long_example_breaks_at_a_shell_space_and_joins_back_whole(command: str) -> None:
    """Broken only where the shell splits words: never in a quoted template or after an escaped
    space; a word longer than the room on its own line; each line but the last ends in " \\"."""
    import shlex

    from cachemgr.cli.render import fit_command

    shown = fit_command("  " + command, 78).split("\n")
    assert all(len(line) <= 78 or len(shlex.split(line.removesuffix(" \\"))) == 1 for line in shown), shown
    assert all(line.endswith(" \\") for line in shown[:-1]), shown
    assert all(line.startswith("      ") for line in shown[1:]), "continued four further in"
    # Joined as a shell joins a line that ends in a backslash: the same words as the command's.
    joined = "".join(line[:-1] if line.endswith("\\") else line for line in shown)
    assert shlex.split(joined) == shlex.split(command)
    assert len(shown) > 1
