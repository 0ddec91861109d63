"""Signing keys (cachemgr.core.signing, ``cachemgr keys``): every bad key input is exit 78 with one
line naming the variable or the file, before anything else runs; key files are private.
"""

from __future__ import annotations

import base64
import os
import stat
from pathlib import Path

import pytest
from cachemgr_testkit.podlib import Cluster, error_lines, free_port, run_cli
from cachemgr_testkit.scenarios import compile_cmd, entry_dirs, server_argv

from cachemgr.core.errors import ConfigError, UsageError
from cachemgr.core.signing import (
    generate_secret_key,
    load_secret_key,
    parse_public_key,
    parse_trusted_keys,
)

# --- the library ------------------------------------------------------------------------------


@pytest.mark.quick
def test_a_generated_key_is_private_signs_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "builder-1.key"
    key = generate_secret_key("builder-1", path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = load_secret_key(path)
    assert again.public == key.public
    assert str(key.public).startswith("builder-1:")
    assert parse_public_key(str(key.public), where="x") == key.public
    signature = key.sign(b"statement")
    assert key.public.verify(b"statement", signature)
    assert not key.public.verify(b"statemenT", signature)
    assert not key.public.verify(b"statement", signature[:-1] + bytes([signature[-1] ^ 1]))


@pytest.mark.quick
def test_generate_never_overwrites_a_key(tmp_path: Path) -> None:
    path = tmp_path / "k"
    first = generate_secret_key("builder-1", path)
    with pytest.raises(UsageError, match="already exists"):
        generate_secret_key("builder-2", path)
    assert load_secret_key(path).public == first.public


@pytest.mark.quick
def test_a_nix_secret_key_file_is_read_as_it_is(tmp_path: Path) -> None:
    """``nix-store --generate-binary-cache-key`` writes NAME:BASE64(seed + public), no newline."""
    made = generate_secret_key("cache.example.org-1", tmp_path / "made")
    nix = tmp_path / "nix"
    nix.write_text(made.to_text())  # no trailing newline, as Nix writes it
    nix.chmod(0o600)
    assert load_secret_key(nix).public == made.public


@pytest.mark.quick
def test_trusted_keys_are_separated_by_whitespace_and_named(tmp_path: Path) -> None:
    one = generate_secret_key("b-1", tmp_path / "1").public
    two = generate_secret_key("b-2", tmp_path / "2").public
    trusted = parse_trusted_keys(f"  {one}\n\t{two} {one} ")
    assert trusted.names == ("b-1", "b-2")
    assert trusted.get("b-2") == two
    assert not parse_trusted_keys("   ")


def _bad_secret(tmp_path: Path, how: str) -> Path:
    path = tmp_path / "secret.key"
    good = generate_secret_key("builder-1", tmp_path / "good").to_text()
    name, _, encoded = good.partition(":")
    raw = base64.b64decode(encoded)
    texts = {
        "no-colon": good.replace(":", ""),
        "short": f"{name}:{base64.b64encode(raw[:40]).decode()}",
        "not-base64": f"{name}:{encoded[:-4]}!!!!",
        "two-keys": f"{good}\n{good}\n",
        "other-public-half": f"{name}:{base64.b64encode(raw[:32] + bytes(32)).decode()}",
        "bad-name": f"bad name:{encoded}",
        "binary": "\xff\xfe",
    }
    if how == "missing":
        return path
    if how == "directory":
        path.mkdir()
        return path
    if how == "fifo":
        os.mkfifo(path, 0o600)
        return path
    path.write_text(good if how == "open-to-others" else texts[how], encoding="latin-1")
    path.chmod(0o644 if how == "open-to-others" else 0o600)
    return path


_BAD_SECRETS = [
    "missing", "directory", "fifo", "open-to-others", "no-colon", "short", "not-base64", "two-keys",
    "other-public-half", "bad-name", "binary",
]  # fmt: skip


@pytest.mark.quick
@pytest.mark.parametrize("how", _BAD_SECRETS)
def test_a_bad_secret_key_file_is_a_config_error_naming_the_variable_and_the_file(
    tmp_path: Path, how: str
) -> None:
    path = _bad_secret(tmp_path, how)
    with pytest.raises(ConfigError) as raised:
        load_secret_key(path, where="CACHEMGR_SIGNING_KEY_FILE")
    line = raised.value.one_line()
    assert "CACHEMGR_SIGNING_KEY_FILE" in line
    assert str(path) in line
    assert "\n" not in line
    assert raised.value.code == 78


@pytest.mark.quick
@pytest.mark.parametrize("shape", ["{secret}", "b@d:{secret}", ":{secret}", "{name}={secret}"])
def test_a_malformed_secret_key_file_is_never_quoted_in_the_error(tmp_path: Path, shape: str) -> None:
    """The error line goes to the logs and the termination message (`kubectl describe pod`): not
    one run of the secret's characters may appear in it, however the file is malformed."""
    name, _, secret = generate_secret_key("builder-1", tmp_path / "good").to_text().partition(":")
    path = tmp_path / "secret.key"
    path.write_text(shape.format(name=name, secret=secret) + "\n")
    path.chmod(0o600)
    with pytest.raises(ConfigError) as raised:
        load_secret_key(path, where="CACHEMGR_SIGNING_KEY_FILE")
    line = raised.value.one_line()
    assert str(path) in line
    leaked = [secret[i : i + 6] for i in range(len(secret) - 6) if secret[i : i + 6] in line]
    assert leaked == [], f"the secret key is quoted in {line!r}"


@pytest.mark.quick
def test_a_key_file_readable_by_the_group_is_accepted_as_a_secret_volume_with_fsgroup_makes_it(
    tmp_path: Path,
) -> None:
    path = tmp_path / "k"
    generate_secret_key("builder-1", path)
    path.chmod(0o440)  # a Kubernetes Secret volume with an fsGroup, whatever its defaultMode
    assert load_secret_key(path).name == "builder-1"
    path.chmod(0o460)
    with pytest.raises(ConfigError, match="open to others"):
        load_secret_key(path)


_BAD_PUBLIC = {
    "no-colon": "builder-1",
    "empty-name": ":AAAA",
    "not-base64": "builder-1:***",
    "short": "builder-1:" + base64.b64encode(bytes(31)).decode(),
    "long": "builder-1:" + base64.b64encode(bytes(33)).decode(),
}


@pytest.mark.quick
@pytest.mark.parametrize("text", list(_BAD_PUBLIC.values()), ids=list(_BAD_PUBLIC))
def test_a_malformed_public_key_is_a_config_error_naming_the_variable(text: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_trusted_keys(f"{text}", where="CACHEMGR_TRUSTED_KEYS")
    assert "CACHEMGR_TRUSTED_KEYS" in raised.value.one_line()


@pytest.mark.quick
def test_one_name_for_two_keys_is_a_config_error(tmp_path: Path) -> None:
    one = generate_secret_key("builder-1", tmp_path / "1").public
    other = generate_secret_key("builder-1", tmp_path / "2").public
    with pytest.raises(ConfigError, match="builder-1 stands for two different public keys"):
        parse_trusted_keys(f"{one} {other}")
    with pytest.raises(ConfigError, match="two different"):
        parse_trusted_keys(str(one)).signing_with(other, where="CACHEMGR_SIGNING_KEY_FILE")
    unlisted = generate_secret_key("builder-2", tmp_path / "3").public
    with pytest.raises(
        ConfigError, match="signs with key builder-2, which CACHEMGR_TRUSTED_KEYS does not list"
    ):
        parse_trusted_keys(str(one)).signing_with(unlisted, where="CACHEMGR_SIGNING_KEY_FILE")
    assert parse_trusted_keys(f"{one} {unlisted}").signing_with(unlisted, where="x").names == (
        "builder-1",
        "builder-2",
    )


# --- the command line -------------------------------------------------------------------------


def test_keys_generate_prints_the_public_key_and_keys_public_prints_it_again(pods: Cluster) -> None:
    secret = pods.work / "keys" / "builder-1.key"
    secret.parent.mkdir()
    made = run_cli("keys", "generate", "--name", "builder-1", "--secret-file", str(secret), env=pods.base_env)
    assert made.returncode == 0, made.stderr
    public = made.stdout.strip()
    assert public.startswith("builder-1:")
    assert len(public.splitlines()) == 1
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    again = run_cli("keys", "public", "--secret-file", str(secret), env=pods.base_env)
    assert again.returncode == 0
    assert again.stdout.strip() == public
    twice = run_cli(
        "keys", "generate", "--name", "builder-1", "--secret-file", str(secret), env=pods.base_env
    )
    assert twice.returncode == 64
    assert "never overwrites" in twice.stderr
    assert run_cli("keys", "public", "--secret-file", str(secret), env=pods.base_env).stdout.strip() == public


def _one_line(stderr: str) -> str:
    lines = error_lines(stderr)  # once per stream, in that stream's format
    assert len(lines) == 1, stderr
    return lines[0]


def _bad_inputs(work: Path) -> dict[str, tuple[dict[str, str], str]]:
    """Each bad key input: the environment that gives it, and what the one line must name."""
    good = generate_secret_key("builder-1", work / "good.key")
    other = generate_secret_key("builder-1", work / "other.key")
    rotated = generate_secret_key("builder-2", work / "rotated.key").public.name
    open_file = work / "open.key"
    open_file.write_text(good.to_text())
    open_file.chmod(0o644)
    malformed = work / "malformed.key"
    malformed.write_text("builder-1:not base64\n")
    malformed.chmod(0o600)
    return {
        "missing-file": ({"CACHEMGR_SIGNING_KEY_FILE": str(work / "none.key")}, str(work / "none.key")),
        "open-file": ({"CACHEMGR_SIGNING_KEY_FILE": str(open_file)}, str(open_file)),
        "malformed-file": ({"CACHEMGR_SIGNING_KEY_FILE": str(malformed)}, str(malformed)),
        "malformed-public": ({"CACHEMGR_TRUSTED_KEYS": "builder-1:nope"}, "CACHEMGR_TRUSTED_KEYS"),
        "two-keys-one-name": (
            {"CACHEMGR_TRUSTED_KEYS": f"{good.public} {other.public}"},
            "CACHEMGR_TRUSTED_KEYS",
        ),
        "signing-key-named-as-another": (
            {"CACHEMGR_TRUSTED_KEYS": str(other.public), "CACHEMGR_SIGNING_KEY_FILE": str(work / "good.key")},
            "CACHEMGR_SIGNING_KEY_FILE",
        ),
        # A rotation in the wrong order: the publisher's new key is not yet what the pods trust.
        "signing-key-not-trusted": (
            {
                "CACHEMGR_TRUSTED_KEYS": str(good.public),
                "CACHEMGR_SIGNING_KEY_FILE": str(work / "rotated.key"),
            },
            f"{rotated}, which CACHEMGR_TRUSTED_KEYS does not list",
        ),
    }


@pytest.mark.parametrize(
    "case",
    ["missing-file", "open-file", "malformed-file", "malformed-public", "two-keys-one-name",
     "signing-key-named-as-another", "signing-key-not-trusted"],
)  # fmt: skip
def test_a_bad_key_input_stops_run_with_78_and_one_line_before_anything_runs(
    pods: Cluster, root: Path, case: str
) -> None:
    env, named = _bad_inputs(pods.work)[case]
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    pod = pods.start("a", server_argv(free_port()), cache_root=root, options=options, env=env)
    assert pod.wait_exit() == 78
    termination = (pod.state_dir / "termination-log").read_text()
    assert named in termination
    assert "\n" not in termination.strip()
    assert entry_dirs(root) == [], "nothing published"
    assert not record.exists(), "nothing compiled"


def test_trusted_keys_set_to_blanks_is_a_config_error_never_the_open_mode(pods: Cluster, root: Path) -> None:
    result = run_cli("ls", "--trusted-keys", "  ", env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)})
    assert result.returncode == 78
    assert "names no key" in _one_line(result.stderr)


@pytest.mark.parametrize("command", ["ls", "verify", "show KEY", "explain"])
def test_inspection_refuses_malformed_trusted_keys_with_78(pods: Cluster, root: Path, command: str) -> None:
    words = command.split()
    tail = ["--", *server_argv(8000)] if words[0] == "explain" else []
    options = ["--strategy", "command", "--compile-cmd", "c {output_dir}"] if words[0] == "explain" else []
    result = run_cli(
        *words, *options, "--trusted-keys", "builder-1:nope", *tail,
        env={**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root)},
    )  # fmt: skip
    assert result.returncode == 78, result.stderr
    assert "CACHEMGR_TRUSTED_KEYS" in _one_line(result.stderr)


# --- an empty setting, and a second setting of the same (issue 33) --------------------------------


def _forged_entry(pods: Cluster, root: Path) -> list[str]:
    """An unsigned entry published by an open pod: what a trusting pod must never serve."""
    record = pods.work / "compiler.jsonl"
    options = ["--strategy", "command", "--compile-cmd", compile_cmd(record)]
    pod = pods.start("forger", server_argv(free_port()), cache_root=root, options=options)
    pod.wait_phase("serving")
    pod.signal(15)
    assert pod.wait_exit() == 0
    return [*options, "--on-miss", "fail"]


@pytest.mark.parametrize(
    ("how", "named"),
    [
        ("CACHEMGR_TRUSTED_KEYS=", "CACHEMGR_TRUSTED_KEYS (--trusted-keys) is set but empty"),
        ("--trusted-keys=", "CACHEMGR_TRUSTED_KEYS (--trusted-keys) is set but empty"),
        ("--trusted=", "CACHEMGR_TRUSTED_KEYS (--trusted-keys) is set but empty"),  # argparse's abbreviation
        ("CACHEMGR_SIGNING_KEY_FILE=", "CACHEMGR_SIGNING_KEY_FILE (--signing-key-file) is set but empty"),
    ],
)
def test_an_empty_trust_setting_is_refused_with_78_never_the_open_mode(
    pods: Cluster, root: Path, how: str, named: str
) -> None:
    """An empty ConfigMap key or an unset shell variable gives the empty string: the likeliest
    mistake, and it silently meant the open mode (a forged unsigned entry launched). The open mode
    is the variable unset."""
    good = generate_secret_key("builder-1", pods.work / "good.key")
    options = _forged_entry(pods, root)
    name, _, value = how.partition("=")
    env = {name: value} if name.startswith("CACHEMGR_") else {}
    flags = [how] if not name.startswith("CACHEMGR_") else []
    if "SIGNING" in name:
        env["CACHEMGR_TRUSTED_KEYS"] = str(good.public)
    pod = pods.start("t", server_argv(free_port()), cache_root=root, options=[*flags, *options], env=env)
    assert pod.wait_exit() == 78, pod.tail()
    termination = (pod.state_dir / "termination-log").read_text()
    assert named in termination
    assert "unset it" in termination
    assert [e for e in pods.record if e["event"] == "load" and str(pod.state_dir) in e["path"]] == []
    if "SIGNING" in name:
        return  # the inspection commands never sign
    cli_env = {**pods.base_env, "CACHEMGR_CACHE_ROOT": str(root), **env}
    for command in (["ls"], ["verify"]):
        done = run_cli(*command, *flags, env=cli_env)
        assert done.returncode == 78, (command, done.stderr)
        assert named in _one_line(done.stderr)


def test_a_command_line_cannot_trust_other_keys_than_the_pods_setting(pods: Cluster, root: Path) -> None:
    """The chart renders trust as CACHEMGR_TRUSTED_KEYS and passes cachemgr.extraArgs as options: an
    option that names other keys (or none) must not override what the chart renders."""
    good = generate_secret_key("builder-1", pods.work / "good.key")
    other = generate_secret_key("other-1", pods.work / "other.key")
    options = _forged_entry(pods, root)
    env = {"CACHEMGR_TRUSTED_KEYS": str(good.public)}
    for flag in (
        f"--trusted-keys={other.public}",
        f"--trusted-keys={good.public} {other.public}",
        "--trusted-k=x",
    ):
        pod = pods.start("t", server_argv(free_port()), cache_root=root, options=[flag, *options], env=env)
        assert pod.wait_exit() == 78, pod.tail()
        termination = (pod.state_dir / "termination-log").read_text()
        assert "--trusted-keys gives other keys than CACHEMGR_TRUSTED_KEYS" in termination
    same = pods.start(
        "same", server_argv(free_port()), cache_root=root, options=[f"--trusted-keys={good.public}", *options],
        env=env,
    )  # fmt: skip
    assert same.wait_exit() == 69, "the same keys twice: a trusting pod, which finds nothing signed"
