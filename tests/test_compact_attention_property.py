"""Compaction is invisible to attention: decode attention over the compacted cache equals attention over the
original cache restricted (by ``slot_mask``) to the kept tokens -- outputs, ALiBi biases from the carried
original positions, and the fused score update of the kept slots (docs/contract.md §2.1, §2.4)."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from kvkernels.paged_attention import Alibi, Restore, ScoreUpdate, paged_decode_attention_ref
from kvkernels.topk_compact import topk_compact
from test_topk_compact import oracle_kept, run, scenarios

TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


@given(case=scenarios(), group=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_attention_over_compacted_cache_equals_masked_original(case, group, seed):
    before, budgets, n_sink, n_recent = case
    page_size, n_kv_heads, dim = before.k.shape[1:]
    batch = len(budgets)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, n_kv_heads * group, dim, generator=g).to(before.k.dtype)
    alibi = torch.rand(n_kv_heads * group, generator=g)
    q_pos = before.lens[0].clone()  # the new token's position

    # Visible in the original cache: exactly the slots the compaction keeps (dense oracle's choice).
    mask = torch.zeros_like(before.pos, dtype=torch.uint8)
    for b in range(batch):
        length = int(before.lens[0][b])
        idx = torch.arange(length)
        pages, offs = before.tables[0][b, idx // page_size].long(), idx % page_size
        for h in range(n_kv_heads):
            kept = oracle_kept(before.score[pages, offs, h].tolist(), budgets[b], n_sink[b], n_recent[b])
            mask[pages[kept], offs[kept], h] = 1

    after = run(topk_compact, before, budgets, n_sink, n_recent)  # on the suite's device, back on the CPU

    scale = dim ** -0.5
    score_full, score_compact = before.score.clone(), after.score.clone()
    out_full = paged_decode_attention_ref(q, before.k, before.v, before.tables[0], before.lens[0],
                                          scale=scale, alibi=Alibi(alibi, before.pos, q_pos),
                                          scores=ScoreUpdate(score_full, "accumulate"),
                                          restore=Restore(slot_mask=mask))
    out_compact = paged_decode_attention_ref(q, after.k, after.v, after.tables[0], after.lens[0],
                                             scale=scale, alibi=Alibi(alibi, after.pos, q_pos),
                                             scores=ScoreUpdate(score_compact, "accumulate"))
    torch.testing.assert_close(out_compact, out_full, atol=TOL[q.dtype], rtol=TOL[q.dtype])

    # The fused score update lands on the same tokens: compare per (sequence, head) in logical order.
    for b in range(batch):
        for h in range(n_kv_heads):
            old_idx = torch.arange(int(before.lens[0][b]))
            old_pages, old_offs = before.tables[0][b, old_idx // page_size].long(), old_idx % page_size
            kept = mask[old_pages, old_offs, h].bool()
            new_idx = torch.arange(int(after.lens[0][b]))
            new_pages, new_offs = after.tables[0][b, new_idx // page_size].long(), new_idx % page_size
            torch.testing.assert_close(score_compact[new_pages, new_offs, h],
                                       score_full[old_pages[kept], old_offs[kept], h], atol=1e-6, rtol=1e-6)
