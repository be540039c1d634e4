"""kvkernels: paged KV-cache kernels (Triton) with pure-torch references.

Every public op is a ``torch.library`` custom op: on CUDA tensors it launches the Triton kernel, on CPU
tensors it runs the torch path. Each kernel file holds the ``@triton.jit`` kernel, its launcher
(``*_triton``), the reference (``*_ref``) and the op, side by side; the package exports the public ops, the
argument bundles of ``paged_decode_attention`` (``Alibi``, ``ScoreUpdate``, ``Restore``), the score-mode
names and the few helpers the caches above use. The launchers and references stay importable from their
modules (tests, benchmarks, ``kvkernels.compile_check``). See ``docs/contract.md`` for shapes and semantics.
"""

from __future__ import annotations

from ._checks import check_shape, check_tensor
from ._modes import SCORE_MODES
from ._noise import decode_keys, gumbel_noise_keyed, noise_seed, prefill_seed
from .merge import magnitude_direction_merge, merge_region, merge_restore
from .paged_attention import Alibi, Restore, ScoreUpdate, paged_decode_attention
from .score_update import COLUMN_SUM_MODES, prefill_attention, prefill_attention_scores, prefill_scores

# The submodule ``topk_compact`` shares its name with the op it defines; importing the op last binds
# ``kvkernels.topk_compact`` to the function, not the module.
from .topk_compact import compaction_plan, topk_compact, topk_evict  # noqa: I001

__all__ = [
    "COLUMN_SUM_MODES",
    "SCORE_MODES",
    "Alibi",
    "Restore",
    "ScoreUpdate",
    "check_shape",
    "compaction_plan",
    "check_tensor",
    "decode_keys",
    "gumbel_noise_keyed",
    "magnitude_direction_merge",
    "merge_region",
    "merge_restore",
    "noise_seed",
    "paged_decode_attention",
    "prefill_attention",
    "prefill_attention_scores",
    "prefill_scores",
    "prefill_seed",
    "topk_compact",
    "topk_evict",
]
