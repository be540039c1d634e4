"""What the parts of a paged cache share: :class:`CacheState`, the attributes ``PagedKVCache.__init__`` and
``start`` set and the methods the cache defines, declared once for the phases (``PrefillSteps``,
``DecodeSteps``, ``ExtendSteps``, ``InspectSteps``) that read them.

It holds no behaviour and sets nothing: a reader of a phase finds here what ``self`` has, and a type checker
checks every attribute a phase reads (a misspelt one is an error). ``PagedKVCache``'s docstring says what
each attribute means.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    import torch

    from kvmodels.replay import Replays
    from kvpolicies import ComposedPolicy
    from kvpolicies.base import EvictionPolicy
    from kvpolicies.plan import CompressionPlan, MergeLayout

    from .compaction import Compaction, Compactor
    from .extend import Extension
    from .mirror import HostMirror
    from .pool import PagePool
    from .rows import SequenceRows
    from .storage import NativeRows
    from .tiers import SideRegion


class CacheState:
    """The shared state of a paged cache's phases (declarations only; ``PagedKVCache`` sets them)."""

    # The parts and the policy.
    policy: ComposedPolicy
    eviction: EvictionPolicy
    storage: NativeRows
    rows: SequenceRows
    layout: MergeLayout
    pool: PagePool
    host: HostMirror
    compactor: Compactor
    side: SideRegion | None
    _replays: Replays

    # Shapes: the pool's rows, and the model's.
    n_layers: int
    n_kv_heads: int
    n_q_heads: int
    head_dim: int
    max_batch: int
    max_tokens: int
    page_size: int
    max_pages: int
    num_pages: int
    kv_heads: int
    q_heads: int
    max_sequences: int
    dtype: torch.dtype
    device: torch.device
    _width: np.ndarray
    _width_masks: list[torch.Tensor]
    windows: tuple[int, ...]
    sliding: list[int]

    # The pool's buffers, and the tables over them.
    k_pages: torch.Tensor
    v_pages: torch.Tensor
    slot_pos: torch.Tensor
    slot_score: torch.Tensor
    free_pages: torch.Tensor
    n_free: torch.Tensor
    k_mag: torch.Tensor | None
    v_mag: torch.Tensor | None
    slot_mask: torch.Tensor | None
    trash_page: int
    page_bytes: int
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    active: torch.Tensor
    budgets: torch.Tensor
    cos_sim: torch.Tensor
    key_scale: torch.Tensor | None

    # Scoring.
    seed: int
    _noise_seed: int
    _noise_step: int
    score_mode: str
    gumbel: bool
    gumbel_keys: torch.Tensor | None
    temperature: torch.Tensor
    decay: float

    # The batch (start) and where its lifecycle stands.
    batch_size: int
    n_sequences: int
    prompt_lens: list[int]
    sequence_prompt_lens: list[int]
    budget_tokens: torch.Tensor
    budget_lens: list[int]  # per pool row: the length its budget is a fraction of (start's, end_extend's)
    reserve: list[int]  # per pool row: slots each layer keeps free at its next plan (a chunk's, start)
    max_new_tokens: int
    plan: CompressionPlan | None
    _state: str
    _step: int
    _extension: Extension | None
    _shared_scores: dict[tuple[int, int], torch.Tensor]
    _split: np.ndarray

    if TYPE_CHECKING:  # defined by PagedKVCache and the phases; declared for the others
        def _check_layer(self, l: int) -> None: ...

        def _plan(self, rows: list[int]) -> CompressionPlan: ...

        def _split_formats(self, rows: list[int]) -> None: ...

        def _compress(self, layers: list[int] | None = None, in_place: bool = False,
                      rows: list[int] | None = None) -> None: ...

        def _compress_calls(self, layers: list[int] | None = None, in_place: bool = False,
                            rows: list[int] | None = None) -> list[Compaction]: ...

        def _compress_rows(self, rows: list[int], budgets: np.ndarray, n_sink: np.ndarray,
                           n_recent: np.ndarray) -> None: ...

        def _token_scores(self, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, *, check: bool = False) -> torch.Tensor: ...

        def prefill_seed(self, l: int, b: int) -> int: ...

        def window(self, l: int) -> int: ...
