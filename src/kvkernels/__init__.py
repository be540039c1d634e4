"""kvkernels: paged KV-cache kernels (Triton) with pure-torch references of the same signature.

Every public op is a ``torch.library`` custom op: on CUDA tensors it launches the Triton kernel, on CPU
tensors it runs the reference. See ``docs/contract.md`` for shapes and semantics.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> submodule; resolved lazily so importing one kernel never pays for (or breaks on) another.
_EXPORTS = {
    "paged_decode_attention": "paged_attention",
    "paged_decode_attention_ref": "paged_attention",
    "paged_decode_attention_triton": "paged_attention",
    "prefill_scores": "score_update",
    "prefill_scores_ref": "score_update",
    "prefill_scores_triton": "score_update",
    "SCORE_MODES": "_modes",
    "update_scores_ref": "_modes",
    "topk_compact": "topk_compact",
    "topk_compact_ref": "topk_compact",
    "topk_compact_triton": "topk_compact",
    "magnitude_direction_merge": "merge",
    "magnitude_direction_merge_ref": "merge",
    "magnitude_direction_merge_triton": "merge",
    "merge_restore": "merge",
    "gumbel_noise_hash": "_noise",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module 'kvkernels' has no attribute {name!r}")

# The submodule ``topk_compact`` shares its name with the op it defines; bind the op so that
# ``from kvkernels import topk_compact`` gives the function, not the module.
from .topk_compact import topk_compact  # noqa: E402
