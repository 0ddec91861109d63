"""The server's argv, read the way the server reads it, reduced to what changes the compile.

A ``vllm serve`` argv is read as vLLM 0.30.0 reads it: its rewrites before argparse and argparse
itself (:mod:`cachemgr.key.vllm_argv`), the ``--config`` file (:mod:`cachemgr.key.vllm_config`) and
each option's value parser (:mod:`cachemgr.key.vllm_values`), all from the generated option table
(:mod:`cachemgr.key.vllm_flags`). tests/test_serving.py checks all of it against the real parser.

Not mirrored, on purpose: values outside an option's choices and config JSON that its dataclass would
reject are keyed, not refused (vLLM refuses them a moment later, so no compile is ever reused for
them); --help is dropped like a runtime flag; without a model the model is None, not vLLM's default.

What goes into the key: every flag given, as the value vLLM stores (``-tp 02`` is 2, ``0.90`` is
0.9, ``--max-model-len 4k`` is 4000), except runtime-only flags (:data:`RUNTIME_ONLY`, reported in
``dropped``). ``--rbln-*`` flags are folded into ``additional_config`` as vllm-rbln folds them; RBLN
options that do not change the compiled graphs and address/port keys of the transfer configs are left
out. Model and revision are keyed separately. Flags this table does not know make the argv be keyed as
given, in order (``unknown_argv``; fail closed: a needless miss costs a compile, a wrong hit costs an
outage), but for the flags known to be runtime-only, which stay out of the key beside them.
The ``vllm`` strategy applies the rules of the server's release on top (cachemgr.key.vllm_key). Any
other server is keyed on its whole argv minus the same runtime-only flags.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

from cachemgr.core.errors import ConfigError
from cachemgr.key.vllm_argv import OWNED, TOP_LEVEL_OPTIONS, flexible_rewrite, serve_parser
from cachemgr.key.vllm_values import refuse

ServerKind = Literal["vllm", "other"]


# Flags that change how the server is reached, named, logged or supervised at run time, never
# what is compiled for the NPU. Each is left out of the key; every other flag counts. Checked
# against vLLM 0.30.0's serve parser (cachemgr.key.vllm_flags): nearly all are "Frontend" options,
# which live only in the API-server process and never reach the engine's config. When in doubt
# a flag is NOT here (seed, tokenizer, data-parallel ranks, reasoning parser... stay in the key).
RUNTIME_ONLY: frozenset[str] = frozenset(
    {
        # process and launcher: which front end runs and how it starts and stops
        "help", "headless", "api-server-count", "grpc", "shutdown-timeout", "fail-on-environ-validation",
        # where and how the API server listens: differs per pod
        "host", "port", "uds", "root-path", "h11-max-incomplete-event-size", "h11-max-header-count",
        "ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "ssl-cert-reqs", "ssl-ciphers", "enable-ssl-refresh",
        # who may call it: CORS and credentials (secrets must never enter a key)
        "allow-credentials", "allowed-origins", "allowed-methods", "allowed-headers", "api-key", "hf-token",
        # the HTTP app around the engine
        "middleware", "enable-request-id-headers", "disable-fastapi-docs", "enable-offline-docs",
        "tokens-only", "enable-scale-out", "enable-tokenizer-info-endpoint",
        "data-parallel-supervisor-port", "dp-supervisor-probe-interval-s", "dp-supervisor-probe-timeout-s",
        "dp-supervisor-probe-failure-threshold",
        # logging, metrics and tracing
        "disable-log-stats", "aggregate-engine-logging", "enable-log-requests", "uvicorn-log-level",
        "disable-uvicorn-access-log", "disable-access-log-for-endpoints", "log-config-file", "max-log-len",
        "enable-log-outputs", "enable-log-deltas", "log-error-stack", "enable-per-request-metrics",
        "enable-server-load-tracking", "show-hidden-metrics-for-version", "otlp-traces-endpoint",
        "collect-detailed-traces", "per-request-spec-decode-metrics", "kv-cache-metrics",
        "kv-cache-metrics-sample", "cudagraph-metrics", "enable-mfu-metrics",
        "enable-logging-iteration-details", "use-tqdm-on-load", "ray-workers-use-nsight",
        # names, chat templates, tools and response formatting: the same compiled model serves them all
        "served-model-name", "chat-template", "chat-template-content-format", "trust-request-chat-template",
        "default-chat-template-kwargs", "tool-call-parser", "tool-parser-plugin", "tool-server",
        "enable-auto-tool-choice", "exclude-tools-when-tool-choice-none", "response-role",
        "return-tokens-as-token-ids", "enable-prompt-tokens-details", "enable-force-include-usage",
        "sse-keep-alive-interval", "cohere-format", "cohere-is-reasoning-model", "fingerprint-mode",
        "fingerprint-value", "enable-flash-late-interaction",
        # request input policy and API-server admission limits
        "allowed-local-media-path", "allowed-media-domains",
        "max-num-queued-reqs", "max-num-queued-tokens", "stream-interval",
        # where weights are downloaded to (their content is keyed by model and revision)
        "download-dir",
        # rendezvous addresses and host CPU pinning of this launch (ParallelConfig.compute_hash
        # ignores them). Not the distributed timeouts nor renderer-num-workers: vLLM's config hash
        # covers those, and vllm-rbln names its mega-cache bundle by that hash, so a pod differing
        # only in them would find no bundle under our entry and compile again inside the server.
        "master-addr", "master-port", "data-parallel-address", "data-parallel-rpc-port",
        "numa-bind", "numa-bind-nodes", "numa-bind-cpus",
        # --config=FILE is never loaded by vLLM (only the exact token --config is); --config FILE is
        # expanded in place, so its path does not matter either
        "config",
    }
)  # fmt: skip

# Keys of the transfer configs that wire this pod to its peers: addresses, ports, engine ids, the
# instance's rank among them. vLLM's KVTransferConfig.compute_hash counts none of its fields, and none
# of these reaches a compiled graph. Every other key (kv_connector, kv_role, buffer sizes...) stays.
_TRANSFER_WIRING: Mapping[str, frozenset[str]] = {
    "kv-transfer-config": frozenset({"kv_ip", "kv_port", "kv_rank", "engine_id"}),
    "ec-transfer-config": frozenset({"ec_ip", "ec_port", "ec_rank", "engine_id"}),
    "kv-events-config": frozenset({"endpoint", "replay_endpoint"}),  # ZMQ publisher sockets
}
# Inside a connector's free-form extra config (MultiConnector children included): the connectors'
# own side channels (handshake_port, notify_port, proxy_ip, llm_host, http_port...).
_CONNECTOR_EXTRA = frozenset({"kv_connector_extra_config", "ec_connector_extra_config"})
_WIRING_KEY = re.compile(r"(^|_)(ip|host|hostname|port|addr|address|url|endpoint)s?$|^(engine_id|kv_rank)$")
# RBLN options that do not change the compiled graphs: RBLNConfig.compute_hash ignores them (sampler
# graphs compile with use_cache=False; sub-block caching changes what runs, not what is built), and the
# optimum path's compiled-model key (_generate_model_path_name) does not read sub_block_size either.
_RBLN_NOT_COMPILED: frozenset[str] = frozenset(
    {"use_custom_sampler", "enable_sub_block_cache", "sub_block_size", "prefix_block_size"}
)
# optimum-rbln overrides that only steer runtime loading (vllm-rbln's _RUNTIME_ONLY_KEYS).
_OPTIMUM_RUNTIME_ONLY: frozenset[str] = frozenset({"device", "create_runtimes", "kvcache_num_blocks"})
# Former additional_config keys vllm-rbln 0.12 still accepts (OptimumRBLNConfig's _RENAMED_KEYS).
_RBLN_RENAMED: Mapping[str, str] = {"rbln_config": "optimum_overrides", "prefix_block_size": "sub_block_size"}
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")  # argparse's _negative_number_matcher
# `python -m` modules that run entry.main(): one parser, no subcommand
_API_SERVER_MODULES = {"vllm.entrypoints.openai.api_server", "vllm.entrypoints.launchers.api_server.entry"}


# Flags runtime-only in every release of vLLM: where and how the API server listens and who may
# call it, how it logs, what it calls the model and how it formats chat, and --config (its content
# is expanded in place). The rules of a release cachemgr was not checked against (STRICT, in
# cachemgr.key.releases) leave out only these: every other flag counts, even one RUNTIME_ONLY names.
ALWAYS_RUNTIME: frozenset[str] = frozenset(
    {
        "help", "host", "port", "uds", "root-path", "ssl-keyfile", "ssl-certfile", "ssl-ca-certs", "ssl-cert-reqs",
        "ssl-ciphers", "enable-ssl-refresh", "allow-credentials", "allowed-origins", "allowed-methods",
        "allowed-headers", "api-key", "hf-token", "middleware", "disable-fastapi-docs", "uvicorn-log-level",
        "disable-uvicorn-access-log", "log-config-file", "disable-log-stats", "enable-log-requests", "max-log-len",
        "served-model-name", "chat-template", "chat-template-content-format", "response-role", "tool-call-parser",
        "tool-parser-plugin", "enable-auto-tool-choice", "download-dir", "config", "master-addr", "master-port",
        "data-parallel-address", "data-parallel-rpc-port",
    }
)  # fmt: skip
_SECRETS = frozenset({"api_key", "hf_token"})  # never in a key, in any release


class ServerCommand(NamedTuple):
    """A server argv and what of it goes into the cache key.

    ``settings`` is the key's view with :data:`RUNTIME_ONLY` left out (the ``command`` strategy and
    other servers key it); ``options`` holds every flag given, as vLLM stores it (secrets aside),
    for the ``vllm`` strategy's per-release rules (cachemgr.key.vllm_key). When the argv has flags
    vLLM 0.30 does not know, ``unknown_argv`` is the whole argv as argparse gets it (secrets masked),
    and ``option_spans`` says where each known option sits in it, so the key can take it as given
    minus the flags its rules leave out (:meth:`argv_without`).
    """

    argv: tuple[str, ...]
    kind: ServerKind
    model: str | None = None
    revision: str | None = None
    settings: Mapping[str, Any] = MappingProxyType({})
    dropped: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    port: int | None = None
    host: str | None = None
    options: Mapping[str, Any] = MappingProxyType({})
    unknown_argv: tuple[str, ...] = ()
    option_spans: tuple[tuple[str, int, int], ...] = ()  # (flag, first, end) of each known option in it

    def argv_without(self, runtime: frozenset[str]) -> list[str]:
        """With unknown flags: the argv as argparse got it, minus the ``runtime`` flags and their values."""
        drop = {i for flag, start, end in self.option_spans if flag in runtime for i in range(start, end)}
        return [token for i, token in enumerate(self.unknown_argv) if i not in drop]

    @property
    def pipeline_parallel_size(self) -> int:
        """PP degree: each rank's compiled output grows with it (space estimates scale by it)."""
        value = self.settings.get("pipeline_parallel_size", 1)
        return value if isinstance(value, int) and value > 0 else 1


def parse_server_argv(argv: Sequence[str]) -> ServerCommand:
    """Read a server argv: ``vllm serve ...`` as vLLM does, anything else token by token."""
    if not argv:
        raise ConfigError(
            "no server command was given",
            remedy="append the server's argv after '--', e.g. cachemgr run -- vllm serve MODEL",
        )
    found = _vllm_args(argv)
    if found is None:
        return _parse_other(tuple(argv))
    args, subcommand = found
    return _parse_vllm(tuple(argv), args, subcommand=subcommand)


def _vllm_args(argv: Sequence[str]) -> tuple[list[str], bool] | None:
    """What vLLM's parse_args receives, and whether via the ``vllm`` CLI (``serve`` first), or None."""
    exe = Path(argv[0]).name
    if exe == "vllm" and len(argv) > 1 and argv[1] == "serve":
        return list(argv[1:]), True
    if re.fullmatch(r"python[\d.]*", exe) and len(argv) > 2 and argv[1] == "-m":
        if argv[2] in _API_SERVER_MODULES:
            return list(argv[3:]), False  # entry.main(): one parser, no subcommand
        if argv[2] == "vllm.entrypoints.cli.main" and len(argv) > 3 and argv[3] == "serve":
            return list(argv[3:]), True
    return None


# --- the key -----------------------------------------------------------------------------------


def _parse_vllm(argv: tuple[str, ...], args: list[str], *, subcommand: bool) -> ServerCommand:
    parser = serve_parser()
    own = TOP_LEVEL_OPTIONS if subcommand else frozenset(parser._option_string_actions)
    tokens = flexible_rewrite(args, own)
    if subcommand:
        tokens = tokens[1:]  # "serve": the sub-parser gets the rest, '--' included
    namespace, extras = parser.parse_known_args(tokens)
    values = {name: value for name, value in vars(namespace).items() if name != OWNED}
    unknown = [t.lstrip("-").partition("=")[0] for t in extras if _looks_like_option(t)]
    if extras and not unknown:
        refuse(f"unrecognized arguments: {' '.join(extras)}")
    model_tag = values.pop("model_tag", None)
    model = values.pop("model", None)
    if subcommand and model_tag is not None:
        model = model_tag  # ServeSubcommand.cmd: the positional wins; the api_server ignores it
    revision = values.pop("revision", None)
    settings: dict[str, Any] = {}
    options: dict[str, Any] = {}
    dropped: list[str] = []
    for dest, value in values.items():
        name = dest.replace("_", "-")
        if dest not in _SECRETS:
            options[dest] = (
                _canonical(value) if dest == "additional_config" else canonical_setting(name, value)
            )
        if name in RUNTIME_ONLY:
            dropped.append(name)
        elif (setting := canonical_setting(name, value)) != {} or dest != "additional_config":
            settings[dest] = setting  # an additional_config of only runtime RBLN options: as if none
    port = values.get("port", 8000)
    return ServerCommand(
        argv=argv,
        kind="vllm",
        model=None if model is None else str(model),
        revision=None if revision is None else str(revision),
        settings=dict(sorted(settings.items())),
        dropped=tuple(sorted(dropped)),
        unknown=tuple(unknown),
        port=port if isinstance(port, int) else None,
        host=values.get("host"),
        options=dict(sorted(options.items())),
        # Fail closed: vLLM 0.30.0 refuses these, and which token a newer vLLM reads as whose value
        # cannot be known, so the argv as argparse gets it is keyed, in order, but for the flags known
        # to be runtime-only (cachemgr.key.vllm_key takes them out, by the release's rules).
        unknown_argv=tuple(_masked(tokens, values)) if unknown else (),
        option_spans=tuple(_option_spans(parser, tokens)) if unknown else (),
    )


def canonical_setting(name: str, value: Any) -> Any:
    """What of option ``name``'s parsed value goes into the key.

    JSON objects have their keys sorted; non-finite floats, which JSON cannot hold, become
    {"$float": "nan"} and the like; the policy above is applied to additional_config and the
    transfer configs.
    """
    if name == "additional-config" and isinstance(value, dict):
        value = compiled_additional_config(value)
    elif name in _TRANSFER_WIRING and isinstance(value, dict):
        value = strip_transfer_wiring(name, value)
    return _canonical(value)


def compiled_additional_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """additional_config without the RBLN options that do not change the compiled graphs."""
    resolved = dict(config)
    for old, new in _RBLN_RENAMED.items():
        if old in resolved:  # vllm-rbln's _resolve: the former name's value wins
            resolved = {k: v for k, v in resolved.items() if k != old} | {new: resolved[old]}
    overrides = resolved.get("optimum_overrides")
    if isinstance(overrides, dict):
        resolved["optimum_overrides"] = _strip_keys(overrides, lambda key: key in _OPTIMUM_RUNTIME_ONLY)
    return {key: value for key, value in resolved.items() if key not in _RBLN_NOT_COMPILED}


def strip_transfer_wiring(name: str, config: Mapping[str, Any]) -> dict[str, Any]:
    """A kv/ec transfer or kv-events config without its addresses, ports, engine ids and ranks."""
    wiring = _TRANSFER_WIRING[name]
    return {
        key: _strip_keys(value, lambda k: bool(_WIRING_KEY.search(k))) if key in _CONNECTOR_EXTRA else value
        for key, value in config.items()
        if key not in wiring
    }


def _strip_keys(obj: Any, drop: Callable[[str], bool]) -> Any:
    if isinstance(obj, dict):
        return {k: _strip_keys(v, drop) for k, v in obj.items() if not drop(str(k))}
    if isinstance(obj, list):
        return [_strip_keys(item, drop) for item in obj]
    return obj


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [_canonical(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return {"$float": str(value)}
    return value


def _masked(tokens: list[str], values: Mapping[str, Any]) -> list[str]:
    """``tokens`` with the values of --api-key and --hf-token masked: secrets never enter a key."""
    given = [values.get("hf_token"), *(values.get("api_key") or [])]
    secrets = {s for s in given if isinstance(s, str) and s}
    return [
        "<secret>" if token in secrets else f"{token.partition('=')[0]}=<secret>"
        if token.partition("=")[2] in secrets else token
        for token in tokens
    ]  # fmt: skip


def _option_spans(parser: argparse.ArgumentParser, tokens: list[str]) -> list[tuple[str, int, int]]:
    """Where each known option and its values sit in ``tokens``, consumed as argparse consumes them."""
    spans: list[tuple[str, int, int]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        found: Any = parser._parse_optional(token) if _looks_like_option(token) else None
        if isinstance(found, list):  # some Python releases return the candidates as a list
            found = found[0] if len(found) == 1 else None
        action = found[0] if found else None  # (action, option string[, sep], explicit value)
        if action is None:
            i += 1
            continue
        assert found is not None
        following = 0
        while i + 1 + following < len(tokens) and not _looks_like_option(tokens[i + 1 + following]):
            following += 1
        nargs = action.nargs
        if found[-1] is not None or nargs == 0:  # --flag=value, or a flag that takes none
            take = 0
        elif nargs is None or nargs == "?":
            take = 1
        else:
            take = nargs if isinstance(nargs, int) else following
        end = i + 1 + min(take, following)
        flag = next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])
        spans.append((flag.lstrip("-"), i, end))
        i = end
    return spans


def _looks_like_option(arg: str) -> bool:
    """An unknown option to argparse: not a positional, not "--", not a negative number ("-1", "-.5")."""
    return arg.startswith("-") and arg not in ("-", "--") and not _NEGATIVE_NUMBER.match(arg)


def _parse_other(argv: tuple[str, ...]) -> ServerCommand:
    """Any other server: the whole argv in order, minus runtime-only flags and their values."""
    kept: list[str] = []
    dropped: list[str] = []
    port: int | None = None
    i = 0
    while i < len(argv):
        token = argv[i]
        name, _, inline = token.lstrip("-").partition("=")
        name = name.replace("_", "-")
        if token.startswith("--") and name in RUNTIME_ONLY:
            dropped.append(name)
            has_value = not inline and i + 1 < len(argv) and not argv[i + 1].startswith("-")
            value = inline or (argv[i + 1] if has_value else None)
            if name == "port":
                port = _int_or_none(value)
            i += 2 if has_value else 1
            continue
        kept.append(token)
        i += 1
    kept[0] = Path(kept[0]).name
    return ServerCommand(
        argv=argv, kind="other", settings={"argv": kept}, dropped=tuple(sorted(set(dropped))), port=port
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
