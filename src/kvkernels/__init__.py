"""kvkernels: paged KV-cache kernels (Triton) with pure-torch references of the same signature.

Every public op is a ``torch.library`` custom op: on CUDA tensors it launches the Triton kernel, on CPU
tensors it runs the torch path. Each kernel file holds the ``@triton.jit`` kernel, its launcher
(``*_triton``), the reference (``*_ref``) and the op, side by side. See ``docs/contract.md`` for shapes
and semantics.
"""

from __future__ import annotations

from ._checks import check_shape, check_tensor
from ._modes import SCORE_MODES, update_scores_ref
from ._noise import draw_gumbel_, gumbel_noise_hash, noise_seed, prefill_seed
from .merge import (
    magnitude_direction_merge,
    magnitude_direction_merge_ref,
    magnitude_direction_merge_triton,
    merge_region,
    merge_restore,
)
from .paged_attention import (
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)
from .score_update import (
    COLUMN_SUM_MODES,
    prefill_attention,
    prefill_attention_scores,
    prefill_scores,
    prefill_scores_ref,
    prefill_scores_torch,
    prefill_scores_triton,
)

# The submodule ``topk_compact`` shares its name with the op it defines; importing the op last binds
# ``kvkernels.topk_compact`` to the function, not the module.
from .topk_compact import (  # noqa: I001
    topk_compact,
    topk_compact_ref,
    topk_compact_torch,
    topk_compact_triton,
    topk_evict,
    topk_evict_ref,
    topk_evict_torch,
)

__all__ = [
    "COLUMN_SUM_MODES",
    "SCORE_MODES",
    "check_shape",
    "check_tensor",
    "draw_gumbel_",
    "gumbel_noise_hash",
    "magnitude_direction_merge",
    "magnitude_direction_merge_ref",
    "magnitude_direction_merge_triton",
    "merge_region",
    "merge_restore",
    "noise_seed",
    "paged_decode_attention",
    "paged_decode_attention_ref",
    "paged_decode_attention_torch",
    "paged_decode_attention_triton",
    "prefill_attention",
    "prefill_attention_scores",
    "prefill_scores",
    "prefill_scores_ref",
    "prefill_scores_torch",
    "prefill_scores_triton",
    "prefill_seed",
    "topk_compact",
    "topk_compact_ref",
    "topk_compact_torch",
    "topk_compact_triton",
    "topk_evict",
    "topk_evict_ref",
    "topk_evict_torch",
    "update_scores_ref",
]
