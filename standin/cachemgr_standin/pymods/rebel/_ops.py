"""STAND-IN for the PyTorch operators rebel registers (``torch.ops.rbln_custom_ops.*``,
``torch.ops.rbln.*``), as CPU code: only those the real server calls on the paths this project runs
(optimum path; vLLM-model path with host tensors). Each is named where the real code calls it."""

from __future__ import annotations

from typing import Any

_done: list[bool] = []


def register() -> None:
    if _done:
        return
    _done.append(True)
    import torch

    lib_custom = torch.library.Library("rbln_custom_ops", "FRAGMENT")
    lib_rbln = torch.library.Library("rbln", "FRAGMENT")
    _libraries.extend([lib_custom, lib_rbln])

    # modeling_decoderonly.py:246: F.linear is swapped for it while the graph is compiled.
    _define(lib_custom, "linear(Tensor input, Tensor weight, Tensor? bias=None) -> Tensor", _linear)
    # vllm_rbln/v1/sample/rbln_sampler.py:91 (greedy): the token ids, [B].
    _define(lib_rbln, "argmax(Tensor logits) -> Tensor", _argmax)
    # rbln_sampler.py:80: sampled token ids from probabilities with per-request top-k/top-p.
    _define(lib_rbln, "top_k_top_p(Tensor probs, Tensor k, Tensor p) -> Tensor", _top_k_top_p)
    # The vLLM-model path's attention without the triton kernels (vllm_rbln/v1/attention/ops/
    # flash_causal_attention_naive.py:47-60, 90-103): the output has the query's shape
    # (triton_flash_causal_attention.py:529 allocates it with empty_like(query)).
    for phase in ("prefill", "decode"):
        _define(
            lib_custom,
            f"flash_causal_attention_naive_{phase}(Tensor q, Tensor k, Tensor v, Tensor kv_cache, "
            "Tensor scale, Tensor seq_idx, Tensor block_tables, Tensor dummy, Tensor? sinks=None, "
            "Tensor? k_scale=None, Tensor? v_scale=None, ScalarType? cache_dtype=None) -> Tensor",
            _attention,
        )


_libraries: list[Any] = []


def _define(lib: Any, schema: str, impl: Any) -> None:
    import torch

    name = schema.split("(", 1)[0]
    lib.define(schema)
    lib.impl(name, impl, "CPU")
    lib.impl(name, impl, "Meta")
    # Under torch.compile the op runs on fake tensors: its output is what the CPU code makes of them.
    torch.library.register_fake(f"{lib.ns}::{name}", impl, lib=lib)


def _linear(input: Any, weight: Any, bias: Any = None) -> Any:
    import torch

    return torch.nn.functional.linear(input, weight, bias)


def _argmax(logits: Any) -> Any:
    return logits.argmax(dim=-1)


def _top_k_top_p(probs: Any, k: Any, p: Any) -> Any:
    """The stand-in samples greedily within top-k/top-p: the most probable token (always kept)."""
    del k, p
    return probs.argmax(dim=-1)


def _attention(q: Any, *args: Any) -> Any:
    """The stand-in attends to nothing: zeros of the query's shape (no kernel runs on a CPU here)."""
    del args
    import torch

    return torch.zeros_like(q)
