"""Completion completes keys and entry names, in bash, zsh and fish (issue 34, item 3).

The scripts are the ones ``cachemgr completion SHELL`` prints, sourced in the real shells (Debian's
``bash``, ``zsh`` and ``fish``; ``scripts/test`` installs them, and CI, CACHEMGR_REQUIRE_MOUNTS=1,
fails without them), with ``cachemgr`` on PATH as in a pod. The volume is real: entries published
by the library's publish path, and names planted as a hostile writer would (spaces, newlines, a
command substitution, a link in place of ``entries/``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cachemgr_testkit.mounts import REQUIRE_MOUNTS_ENV
from cachemgr_testkit.scenarios import command_key

from cachemgr.volume.identity import PodIdentity
from cachemgr.volume.layout import open_root
from cachemgr.volume.store import create_staging, publish

BIN = Path(sys.executable).parent  # the venv's bin: cachemgr is on PATH as in a pod


def a_shell(name: str) -> str:
    found = shutil.which(name)
    if found is None:
        if os.environ.get(REQUIRE_MOUNTS_ENV) == "1":
            pytest.fail(f"{name} is not installed (Debian package {name}; scripts/test installs it)")
        pytest.skip(f"{name} is not installed (apt-get install {name})")
    return found


@pytest.fixture
def volume(tmp_path: Path) -> tuple[Path, str, str]:
    """A volume with one entry (its name and short key), and names no shell word may carry."""
    path = tmp_path / "volume"
    path.mkdir()
    root = open_root(path, create=True)
    key = command_key()
    staging = create_staging(root, key, PodIdentity("pod-a", "node-a", "host-a", os.getpid()))
    (staging.artifacts / "model.bin").write_bytes(b"x" * 64)
    identity = PodIdentity("pod-a", "node-a", "host-a", os.getpid())
    publish(root, staging, key, identity=identity, compile_seconds=1.0, strategy="command")
    for hostile in (
        "a b__0123456789abcdef",
        "$(touch PWNED)__0123456789abcdef",
        "line\nbreak__abcdef0123456789",
    ):
        (path / "entries" / hostile).mkdir()
    (path / "failures" / "feedfacefeedfacefeedfacefeedface").mkdir(parents=True)
    return path, key.entry_name, key.digest[:12]


def env_for(root: Path) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "CACHEMGR_CACHE_ROOT": str(root)}


def script(shell: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "cachemgr", "completion", shell],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return done.stdout


def test_bash_completes_keys_and_entry_names_from_the_volume(
    volume: tuple[Path, str, str], tmp_path: Path
) -> None:
    root, name, short = volume
    bash = a_shell("bash")
    (tmp_path / "c.bash").write_text(script("bash"))
    probe = f"""source {tmp_path / "c.bash"}
complete_line() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMPREPLY=(); _shtab_cachemgr; printf '%s\\n' "${{COMPREPLY[@]}}"; }}
echo '--- show'; complete_line cachemgr show {short[:4]}
echo '--- verify'; complete_line cachemgr verify {name[:6]}
echo '--- prune'; complete_line cachemgr prune --key ''
"""
    shown = subprocess.run(
        [bash, "-c", probe], env=env_for(root), capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr
    parts = dict(part.split("\n", 1) for part in shown.stdout.split("--- ")[1:])
    assert parts["show"].split() == [short], parts
    assert parts["verify"].split() == [name], parts
    assert set(parts["prune"].split()) == {short, name, "feedfacefeed"}, parts
    assert not (tmp_path / "PWNED").exists()
    assert "PWNED" not in shown.stdout


def test_fish_completes_them_too(volume: tuple[Path, str, str], tmp_path: Path) -> None:
    root, name, short = volume
    fish = a_shell("fish")
    (tmp_path / "cachemgr.fish").write_text(script("fish"))
    probe = (
        f"source {tmp_path / 'cachemgr.fish'}; "
        f"echo '--- show'; complete -C 'cachemgr show {short[:4]}'; "
        f"echo '--- prune'; complete -C 'cachemgr prune --key '; "
        "echo '--- commands'; complete -C 'cachemgr pr'"
    )
    shown = subprocess.run(
        [fish, "-c", probe], env=env_for(root), capture_output=True, text=True, timeout=60, check=False
    )
    assert shown.returncode == 0, shown.stderr
    parts = {
        p.split("\n", 1)[0]: [line.split("\t")[0] for line in p.split("\n")[1:] if line]
        for p in shown.stdout.split("--- ")[1:]
    }
    assert parts["show"] == [short], parts
    assert set(parts["prune"]) == {short, name, "feedfacefeed"}, parts
    assert {"prune", "probe"} <= set(parts["commands"]), parts


def test_zsh_takes_the_same_list(volume: tuple[Path, str, str], tmp_path: Path) -> None:
    root, name, short = volume
    zsh = a_shell("zsh")
    text = script("zsh")
    checked = subprocess.run([zsh, "-n"], input=text, text=True, capture_output=True, check=False)
    assert checked.returncode == 0, checked.stderr
    action = '(${(f)"$(cachemgr completion --keys 2>/dev/null)"})'
    assert f":{action}" in text, "show's KEY completes from the volume"
    # The action's word list, expanded by zsh as _arguments expands it: one word per name.
    shown = subprocess.run(
        [zsh, "-c", f"words={action}; print -l -- $words"],
        env=env_for(root),
        capture_output=True,
        text=True,
        check=False,
    )
    assert set(shown.stdout.split("\n")) - {""} == {short, name, "feedfacefeed"}, shown.stdout


def test_the_key_list_is_bounded_plain_and_never_fails(tmp_path: Path) -> None:
    root = tmp_path / "volume"
    (root / "entries").mkdir(parents=True)
    for i in range(700):
        (root / "entries" / f"org--model-{i:04d}__prefill__c0.12__RBLN-CA25__{i:016x}").mkdir()
    listed = subprocess.run(
        [sys.executable, "-m", "cachemgr", "completion", "--keys"],
        env=env_for(root),
        capture_output=True,
        text=True,
        check=False,
    )
    assert listed.returncode == 0, listed.stderr
    assert len(listed.stdout.splitlines()) == 500, "at most 500 candidates"
    # A link in place of entries/, and no volume at all: nothing, and no error, exit 0.
    shutil.rmtree(root / "entries")
    (root / "entries").symlink_to(tmp_path)
    for where in (root, tmp_path / "missing"):
        done = subprocess.run(
            [sys.executable, "-m", "cachemgr", "completion", "--keys", "o"],
            env=env_for(where),
            capture_output=True,
            text=True,
            check=False,
        )
        assert (done.returncode, done.stdout, done.stderr) == (0, "", ""), done


# --- -o / --output (issue 40) ---------------------------------------------------------------------

LS_FORMS = {"table", "wide", "json", "yaml", "name", "jsonpath=", "custom-columns="}


def test_bash_completes_the_output_forms_each_command_has(tmp_path: Path) -> None:
    """Completion offered nothing after ``-o``: each command's forms now, and no space after one
    whose text follows its ``=`` (bash's ``compopt -o nospace``, asked in the completion itself)."""
    bash = a_shell("bash")
    (tmp_path / "c.bash").write_text(script("bash"))
    probe = f"""source {tmp_path / "c.bash"}
complete_line() {{ COMP_WORDS=("$@"); COMP_CWORD=$(( $# - 1 )); COMPREPLY=(); _cachemgr_complete; printf '%s\\n' "${{COMPREPLY[@]}}"; }}
compopt() {{ echo "compopt $*"; }}  # bash's own refuses outside a real completion: say what was asked
echo '--- ls'; complete_line cachemgr ls -o ''
echo '--- ls-j'; complete_line cachemgr ls --output j
echo '--- key'; complete_line cachemgr key -o ''
echo '--- custom'; complete_line cachemgr ls -o cu
echo '--- registered'; complete -p cachemgr
"""
    shown = subprocess.run([bash, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    parts = dict(part.split("\n", 1) for part in shown.stdout.split("--- ")[1:])
    assert set(parts["ls"].split()) == LS_FORMS, parts
    assert parts["ls-j"].split() == ["json", "jsonpath="], parts
    assert set(parts["key"].split()) == LS_FORMS - {"name"}, "key has no -o name"
    assert parts["custom"].split() == ["compopt", "-o", "nospace", "custom-columns="], parts
    assert "-F _cachemgr_complete cachemgr" in parts["registered"], parts


def test_fish_completes_the_output_forms_too(tmp_path: Path) -> None:
    fish = a_shell("fish")
    (tmp_path / "cachemgr.fish").write_text(script("fish"))
    probe = (
        f"source {tmp_path / 'cachemgr.fish'}; "
        "echo '--- ls'; complete -C 'cachemgr ls -o '; "
        "echo '--- key'; complete -C 'cachemgr key --output '; "
        "echo '--- stats'; complete -C 'cachemgr stats -o js'"
    )
    shown = subprocess.run([fish, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    parts = {
        p.split("\n", 1)[0]: {line.split("\t")[0] for line in p.split("\n")[1:] if line}
        for p in shown.stdout.split("--- ")[1:]
    }
    assert parts["ls"] == LS_FORMS, parts
    assert parts["key"] == LS_FORMS - {"name"}, parts
    assert parts["stats"] == {"json", "jsonpath="}, parts


def test_zsh_adds_the_output_forms_with_no_space_after_an_equals(tmp_path: Path) -> None:
    """The action zsh's ``_arguments`` runs after ``ls -o``, run by zsh with ``compadd`` saying
    what it was given (outside a completion widget zsh's own adds nothing)."""
    zsh = a_shell("zsh")
    text = script("zsh")
    checked = subprocess.run([zsh, "-n"], input=text, text=True, capture_output=True, check=False)
    assert checked.returncode == 0, checked.stderr
    ls = text[text.index("_shtab_cachemgr_ls_options=(") :]
    line = next(line for line in ls.splitlines() if line.lstrip().startswith("{-o,--output}"))
    action = line[line.index("]:FORMAT:") + len("]:FORMAT:") : line.rindex('"')]
    assert action[0] + action[-1] == "{}", action
    probe = f'compadd() {{ print -r -- "$*" }}\n{action[1:-1]}\n'
    shown = subprocess.run([zsh, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert shown.returncode == 0, shown.stderr
    plain, texts = shown.stdout.splitlines()
    assert plain.split()[0] == "--"
    assert set(plain.split()[1:]) == LS_FORMS - {"jsonpath=", "custom-columns="}
    assert texts.split() == ["-S", "--", "jsonpath=", "custom-columns="], "no suffix: the text follows"
