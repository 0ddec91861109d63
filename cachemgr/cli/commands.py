"""Every command's parser: what it is for, its options, its examples (``cachemgr COMMAND --help``).

Each command opens its help with its purpose and ends it with two or three examples; the option
groups several commands share are :mod:`cachemgr.cli.options`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

from cachemgr.cli.options import (
    FORMATTER,
    SIZE,
    add_compat,
    add_key,
    add_log,
    add_output,
    add_progress,
    add_remote,
    add_root,
    add_run,
    add_trusted,
    duration_option,
    env,
    size,
)


def _command(
    sub: Any, name: str, summary: str, about: str, examples: Sequence[str]
) -> argparse.ArgumentParser:
    """A command's parser: its purpose first, its examples last (``cachemgr NAME --help``)."""
    lines = "\n".join(f"  {example}" for example in examples)
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=f"{summary[:1].upper()}{summary[1:]}.\n\n{about}",
        epilog=f"examples:\n{lines}",
        formatter_class=FORMATTER,
    )
    return parser


_SERVER = "vllm serve MiniMaxAI/MiniMax-M2.7 --tensor-parallel-size 8 --max-model-len 32768"


def _add_run_command(sub: Any, name: str) -> None:
    if name == "run":
        cmd = _command(
            sub,
            name,
            "the pod entrypoint: reuse or compile once, then launch and supervise the server",
            "Computes the key of -- SERVER ARGV, loads the role's published entry or takes the key's lease\n"
            "and compiles it once (peers wait), then runs the server on a pod-local view of the entry.\n\n"
            "Usage: cachemgr run [options] -- SERVER ARGV",
            [
                f"cachemgr run --status-port 9090 -- {_SERVER} --port 8000",
                f"cachemgr run --on-miss fail -- {_SERVER}",
            ],
        )
    else:
        cmd = _command(
            sub,
            name,
            "fill the cache for this argv (a Job before a rollout) and exit 0",
            "The same flow as 'run', for a Job: it exits 0 once the entry is published (or was there),\n"
            "with a one-line summary, and writes no probe state.\n\n"
            "Usage: cachemgr warm [options] -- SERVER ARGV",
            [
                f"cachemgr warm -- {_SERVER} --model-impl vllm",
                f"cachemgr warm --remote s3://bucket/prod -- {_SERVER}",
            ],
        )
    add_root(cmd)
    add_key(cmd)
    add_run(cmd)
    add_progress(cmd)
    add_log(cmd, pod=True)


def _add_key_command(sub: Any, name: str) -> None:
    if name == "key":
        cmd = _command(
            sub,
            name,
            "print the cache key of -- SERVER ARGV and where each input came from",
            "Needs no volume: the key is computed as 'cachemgr run' would, from this image's compiler,\n"
            "NPU and the server's argv; runtime-only flags (host, port...) are named and left out.",
            [f"cachemgr key -- {_SERVER}", f"cachemgr key -o json -- {_SERVER} | jq .key"],
        )
        add_key(cmd)
        add_output(cmd, "table", "wide", "json", "yaml")
    else:
        cmd = _command(
            sub,
            name,
            "hit or miss for -- SERVER ARGV here, and on a miss what differs from the nearest entries",
            "The same argv as the pod's 'cachemgr run -- ...'. A hit names the entry; a miss ranks the\n"
            "role's entries by how few key inputs differ and says what to do.",
            [
                f"cachemgr explain -- {_SERVER} --port 8000",
                f"cachemgr explain --compiler-version 0.14.0 -- {_SERVER}",
            ],
        )
        add_root(cmd)
        add_trusted(cmd)
        add_key(cmd)
        add_output(cmd, "table", "wide", "json", "yaml")
    add_log(cmd)


def _add_demo_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "two prefill and two decode pods, cold then warm, with the stand-in compiler and server",
        "Runs four real 'cachemgr run' processes against the stand-in vllm server (no NPU needed) and\n"
        "checks the promise: one compile per role when cold, none when warm.",
        ["cachemgr demo", "cachemgr demo --dir /tmp/demo --compile-seconds 1", "cachemgr demo --remote"],
    )
    cmd.add_argument(
        "--dir",
        default="demo-cache",
        metavar="DIR",
        help="where the demo volumes go (default ./demo-cache): a new or empty directory, or one an "
        "earlier demo made, which it removes first (any other is refused)",
    )
    duration_option(
        cmd, "--compile-seconds", default="3", help="how long the stand-in compiler takes (default 3s)"
    )
    cmd.add_argument(
        "--remote",
        action="store_true",
        help="two clusters and one bucket (a local SeaweedFS: needs weed, boto3)",
    )
    add_log(cmd)


def _add_ls_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "what is cached: one row per entry, then compile attempts, failed compiles and quarantine",
        "Reads each entry's summary (never its files: 'cachemgr verify' checks those), its users and\n"
        "its hits. Runs in any pod of the role, on a read-only volume too.",
        ["cachemgr ls", "cachemgr ls -o wide", "cachemgr ls -o json | jq '.[] | select(.kind == \"entry\")'"],
    )
    add_root(cmd)
    add_output(cmd, sort=True)
    add_compat(cmd)
    add_remote(cmd, listing=True)
    add_trusted(cmd)
    add_log(cmd)


def _add_du_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "how much space: the volume as the pod can use it, the cache by part, compiler and entry",
        "Ends with what each 'cachemgr prune' selector would free now, never counting an entry in use.",
        ["cachemgr du", "cachemgr du -o json | jq .prunable"],
    )
    add_root(cmd)
    add_output(cmd, "table", "wide", "json", "yaml")
    add_compat(cmd)
    add_log(cmd)


def _add_locks_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "who is compiling: each compile lease, its holder, and whether it is live, stalled or stale",
        "Ages are by this node's clock from the lease marker's mtime; the PROGRESS section is the\n"
        "compile as its holder reports it.",
        ["cachemgr locks", "cachemgr locks -o wide", "cachemgr locks -o json"],
    )
    add_root(cmd)
    add_output(cmd, sort=True)
    add_log(cmd)


def _add_stats_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "how well the cache works: hits, misses, compiles and the compile time saved, per entry",
        "Counted from the volume's own records (the use record each pod start leaves, the entries'\n"
        "summaries and the failure records): every pod of the role, since each entry was published.",
        ["cachemgr stats", "cachemgr stats -o json | jq .volume"],
    )
    add_root(cmd)
    add_output(cmd, sort=True)
    add_log(cmd)


def _add_show_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "everything about one key: inputs, files check, users, lease, attempts and failures",
        "KEY is a unique prefix of the key, or the entry's name. The status comes from the check\n"
        "'show' makes (every file's size and mtime against the manifest; 'verify' hashes them).",
        ["cachemgr show 661096f8", "cachemgr show 661096f8 -o json | jq .failures"],
    )
    cmd.add_argument("key", metavar="KEY", help="a unique prefix of the key, or the entry name")
    add_root(cmd)
    add_output(cmd, "table", "wide", "json", "yaml")
    add_compat(cmd)
    add_trusted(cmd)
    add_log(cmd)


def _add_verify_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "is anything damaged: hash every file of the entries against their manifests",
        "Exits 74 when it finds damage, also with --fix (damage on a volume is worth an alert even\n"
        "once moved aside). --fix moves only damaged entries to quarantine/. With --trusted-keys it\n"
        "also checks each entry's signature and its signed hashes; --fix then moves untrusted ones too.",
        ["cachemgr verify", "cachemgr verify 661096f8", "cachemgr verify --fix"],
    )
    cmd.add_argument(
        "keys", nargs="*", metavar="KEY", help="key prefixes or entry names (default: every entry)"
    )
    cmd.add_argument(
        "--fix",
        action="store_true",
        help="move damaged (and with --trusted-keys, untrusted) entries to quarantine/ (the next start compiles them)",
    )
    add_root(cmd)
    add_output(cmd, sort=True)
    add_trusted(cmd)
    add_progress(cmd)
    add_log(cmd)


def _add_prune_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "what can go: plan, then remove in a safe order, never an entry in use",
        "At least one selector. Without --yes it asks on a terminal, and without one prints the plan\n"
        "and exits 64; --dry-run only prints the plan.",
        [
            "cachemgr prune --incompatible --superseded --dry-run",
            "cachemgr prune --unused-for 14d --yes",
            "cachemgr prune --key 661096f8 --yes",
        ],
    )
    group = cmd.add_argument_group("what may go (selectors)")
    group.add_argument(
        "--incompatible",
        action="store_true",
        help="entries of an older compiler major.minor (or key schema) than this image's: no pod of it can "
        "use them; a newer image's entries are never chosen",
    )
    group.add_argument(
        "--superseded",
        action="store_true",
        help="entries of an older server (vllm-rbln, vLLM, optimum-rbln, transformers) than this image's with "
        "the same compiler, or older than another entry of their model, role and NPU; never a newer image's",
    )
    group.add_argument(
        "--for-npu",
        action="append",
        default=[],
        dest="for_npu",
        metavar="TYPE",
        help="entries compiled for this NPU type, e.g. RBLN-CA12 (repeatable): pods of that hardware "
        "sharing the volume use them, so they go only when named",
    )
    group.add_argument(
        "--npu",
        action="append",
        default=[],
        dest="npu",
        metavar="TYPE",
        help="deprecated spelling of --for-npu",
    )
    duration_option(group, "--unused-for", help="entries unused for this long, e.g. 14d")
    group.add_argument(
        "--keep-bytes",
        type=size,
        default=None,
        metavar=SIZE,
        help="remove least recently used entries until the cache fits, e.g. 150Gi",
    )
    group.add_argument(
        "--stale-staging", action="store_true", help="compile attempts (and their leases) left by dead pods"
    )
    group.add_argument("--damaged", action="store_true", help="quarantined and damaged entries")
    group.add_argument(
        "--failures",
        action="store_true",
        help="failure records of failed compiles (what 'show KEY' lists; they never block a start)",
    )
    group.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY",
        help="this entry: a key prefix or an entry name (repeatable), e.g. one its server cannot load; "
        "with --remote, the bucket's (--unused-for counts from the upload there)",
    )
    cmd.add_argument("--dry-run", action="store_true", help="print the plan only")
    cmd.add_argument("--yes", action="store_true", help="do it without asking (required without a terminal)")
    add_remote(cmd, listing=True)
    add_root(cmd)
    add_output(cmd)
    add_compat(cmd)
    add_progress(cmd)
    add_log(cmd)


def _add_push_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "upload published entries to the remote tier (manifest last)",
        "Entries already in the remote are skipped. Each entry's upload ends at --budget: then\n"
        "it is abandoned (no manifest goes up), one line says so, and push goes on with the next.\n"
        "Exits 73 when the bucket is full, 74 when the remote or the volume cannot be used (also\n"
        "when an entry ran out of its budget), 128+N on signal N (SIGINT, SIGTERM).",
        ["cachemgr push --remote s3://bucket/prod", "cachemgr push 661096f8"],
    )
    cmd.add_argument(
        "keys", nargs="*", metavar="KEY", help="key prefixes or entry names (default: every entry)"
    )
    cmd.add_argument("--force", action="store_true", help="upload even if the remote has the entry")
    add_remote(cmd)
    add_root(cmd)
    add_output(cmd, "table", "wide", "json", "yaml")
    add_log(cmd)


def _add_pull_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "download an entry from the remote tier, check it, publish it here",
        "The download is checked against the remote manifest before it is published by the same\n"
        "atomic rename a compile uses. It ends at --budget (exit 74) or on SIGINT/SIGTERM (128+N):\n"
        "its partial files are removed then, and nothing is published.",
        ["cachemgr pull 661096f8", "cachemgr pull 661096f8 --remote s3://bucket/prod"],
    )
    cmd.add_argument(
        "key", metavar="KEY", help="a key prefix or entry name ('cachemgr ls --remote' lists them)"
    )
    add_remote(cmd)
    add_root(cmd)
    add_output(cmd, "table", "wide", "json", "yaml")
    add_trusted(cmd)
    add_log(cmd)


def _add_keys_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "signing keys: generate a key pair, or print a secret key's public key",
        "A publisher (a warm Job, a builder) signs what it publishes with the secret key\n"
        "(CACHEMGR_SIGNING_KEY_FILE); pods trust the public key NAME:BASE64 (CACHEMGR_TRUSTED_KEYS).\n"
        "Name keys NAME-N (builder-1, then builder-2) so that they can rotate.",
        [
            "cachemgr keys generate --name builder-1 --secret-file ./signing.key",
            "cachemgr keys public --secret-file ./signing.key",
        ],
    )
    cmd.add_argument(
        "action", choices=["generate", "public"], help="make a new key pair, or print the public key"
    )
    cmd.add_argument(
        "--name",
        metavar="NAME",
        help="generate: the key's name, NAME-N (builder-1, then builder-2 to rotate)",
    )
    cmd.add_argument(
        "--secret-file",
        required=True,
        metavar="FILE",
        help="the secret key file (generate: written with mode 0600, never over an existing file)",
    )
    add_log(cmd)


def _add_probe_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "Kubernetes exec probe: startup, live or ready",
        "Reads the state record 'cachemgr run' keeps in its state dir; prints one line and exits 0\n"
        "(pass) or 1 (fail). Standard library only: it runs in every pod every few seconds.",
        ["cachemgr probe startup", "cachemgr probe ready --timeout 2s"],
    )
    cmd.add_argument("kind", choices=["startup", "live", "ready"], help="which probe")
    cmd.add_argument(
        "--state-dir",
        default=env("CACHEMGR_STATE_DIR"),
        metavar="DIR",
        help="the run's pod-local state [env CACHEMGR_STATE_DIR; default /tmp/cachemgr-state]",
    )
    duration_option(
        cmd,
        "--timeout",
        default="1",
        help="ready: how long the server's health request may take (default 1s)",
    )


def _add_completion_command(sub: Any, name: str) -> None:
    cmd = _command(
        sub,
        name,
        "print a shell completion script for bash, zsh or fish",
        "Generated from this parser (shtab), so every command and option completes as it is today;\n"
        "a KEY (show, verify, prune --key, push) completes to the keys and entry names of the volume\n"
        "in CACHEMGR_CACHE_ROOT, read from its directory listings alone.",
        [
            "source <(cachemgr completion bash)",
            'cachemgr completion zsh > "${fpath[1]}/_cachemgr"',
            "cachemgr completion fish > ~/.config/fish/completions/cachemgr.fish",
        ],
    )
    cmd.add_argument("shell", nargs="?", choices=["bash", "zsh", "fish"], help="the shell to complete in")
    cmd.add_argument(
        "--keys",
        nargs="?",
        const="",
        default=None,
        metavar="PREFIX",
        help="print the volume's keys and entry names that start with PREFIX, one a line (what the "
        "scripts call while completing a KEY)",
    )


# Each command's arguments, in the order `cachemgr --help` lists them.
COMMANDS: dict[str, Callable[[Any, str], None]] = {
    "run": _add_run_command,
    "warm": _add_run_command,
    "key": _add_key_command,
    "explain": _add_key_command,
    "demo": _add_demo_command,
    "ls": _add_ls_command,
    "du": _add_du_command,
    "locks": _add_locks_command,
    "stats": _add_stats_command,
    "show": _add_show_command,
    "verify": _add_verify_command,
    "prune": _add_prune_command,
    "push": _add_push_command,
    "pull": _add_pull_command,
    "keys": _add_keys_command,
    "probe": _add_probe_command,
    "completion": _add_completion_command,
}
