"""paged_decode_attention: reference vs a dense oracle, the vectorised CPU path and Triton (interpreter) vs
the reference, properties, bad input, and the op under torch.compile.

Cases are built dense first (per sequence ``[L, Hkv, ...]``) and scattered into a shuffled page pool whose
unused K/V slots hold NaN, so any read outside a sequence's valid slots poisons the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from devices import DEVICE, KERNEL_DTYPES, assert_within
from kvkernels._modes import SCORE_MODES
from kvkernels._noise import gumbel_noise_keyed
from kvkernels.paged_attention import (
    Alibi,
    Restore,
    ScoreUpdate,
    _paged_decode_attention_op,
    paged_decode_attention,
    paged_decode_attention_ref,
    paged_decode_attention_torch,
    paged_decode_attention_triton,
)

KERNEL_DTYPES = list(KERNEL_DTYPES)  # the interpreter has no bf16; on a GPU every dtype runs
MASK_BIT = 2
DECAY = 0.75


@dataclass
class Case:
    lens: list[int]
    page_size: int
    q: torch.Tensor  # [B, Hq, D]
    dense: dict[str, torch.Tensor]  # per-sequence dense views, [B, Lmax, Hkv, ...]
    pool: dict[str, torch.Tensor]  # k_pages, v_pages, slot_pos, k_scale, v_scale, slot_mask, score
    page_table: torch.Tensor  # [B, M] int32
    seq_lens: torch.Tensor  # [B] int32
    q_pos: torch.Tensor  # [B] int32
    slopes: torch.Tensor  # [Hq] f32
    noise_key: torch.Tensor  # [B, Hq] int32: ScoreUpdate.gumbel_key
    noise: torch.Tensor  # [B, Hq, M * S] f32: the Gumbel noise the key stands for (gumbel_noise_keyed)
    temperature: torch.Tensor  # [1] f32

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.pool["k_pages"].shape[2]


def make_case(seed: int, lens: list[int], *, page_size: int, n_kv_heads: int, group: int, head_dim: int,
              dtype: torch.dtype, device: torch.device = DEVICE) -> Case:
    gen = torch.Generator().manual_seed(seed)
    batch, n_q_heads, S = len(lens), n_kv_heads * group, page_size
    lmax = max(lens + [1])
    pages_needed = [math.ceil(n / S) for n in lens]
    max_pages = math.ceil(lmax / S) + 1  # one spare column holding -1, as after a free
    num_pages = sum(pages_needed) + 2  # two pages nobody owns
    perm = torch.randperm(num_pages, generator=gen)
    page_table = torch.full((batch, max_pages), -1, dtype=torch.int32)
    used = 0
    for b, need in enumerate(pages_needed):
        page_table[b, :need] = perm[used:used + need].to(torch.int32)
        used += need

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    # Original positions grow with the slot index but skip some tokens (evicted ones), per head.
    pos = torch.randint(1, 4, (batch, lmax, n_kv_heads), generator=gen).cumsum(1).to(torch.int32)
    dense = {
        "k_pages": randn(batch, lmax, n_kv_heads, head_dim).to(dtype),
        "v_pages": randn(batch, lmax, n_kv_heads, head_dim).to(dtype),
        "slot_pos": pos,
        "k_scale": torch.rand(batch, lmax, n_kv_heads, generator=gen) + 0.5,
        "v_scale": torch.rand(batch, lmax, n_kv_heads, generator=gen) + 0.5,
        "slot_mask": torch.randint(0, 4, (batch, lmax, n_kv_heads), generator=gen).to(torch.uint8),
        "score": randn(batch, lmax, n_kv_heads),
    }
    fills = {"k_pages": float("nan"), "v_pages": float("nan"), "slot_pos": 10**6, "k_scale": float("nan"),
             "v_scale": float("nan"), "slot_mask": 255, "score": -7.0}
    pool = {}
    for name, d in dense.items():
        p = torch.full((num_pages, S, *d.shape[2:]), fills[name], dtype=d.dtype)
        for b, n in enumerate(lens):
            slots = torch.arange(n)
            p[page_table[b, slots // S].long(), slots % S] = d[b, :n]
        pool[name] = p.to(device)
    noise_key = torch.randint(-2**31, 2**31 - 1, (batch, n_q_heads), generator=gen, dtype=torch.int32)
    return Case(
        lens=list(lens), page_size=S,
        q=randn(batch, n_q_heads, head_dim).to(dtype).to(device),
        dense=dense, pool=pool, page_table=page_table.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        q_pos=(pos[:, -1].amax(1) + torch.randint(0, 3, (batch,), generator=gen)).to(device, torch.int32),
        slopes=(torch.rand(n_q_heads, generator=gen) * 0.5).to(device),
        noise_key=noise_key.to(device),
        noise=gumbel_noise_keyed(noise_key, max_pages * S).to(device),
        temperature=torch.tensor([0.5 + torch.rand(1, generator=gen).item() * 1.5], device=device),
    )


def op_kwargs(case: Case, *, mode: str, alibi: bool, k_scale: bool, v_scale: bool, mask: bool,
              num_splits: int = 0, score: torch.Tensor | None = None) -> dict:
    """Keyword arguments of the public op, which its three implementations share."""
    pool = case.pool
    gumbel = mode == "gumbel"
    restore = k_scale or v_scale or mask
    return dict(
        scale=case.q.shape[-1] ** -0.5,
        alibi=Alibi(case.slopes, pool["slot_pos"], case.q_pos) if alibi else None,
        scores=None if score is None else ScoreUpdate(score, mode, DECAY, case.noise_key if gumbel else None,
                                                      case.temperature if gumbel else None),
        restore=Restore(pool["k_scale"] if k_scale else None, pool["v_scale"] if v_scale else None,
                        pool["slot_mask"] if mask else None, MASK_BIT) if restore else None,
        num_splits=num_splits,
    )


def run(impl, case: Case, **flags) -> tuple[torch.Tensor, torch.Tensor]:
    """Run ``impl`` on the case; return (out, the pool's score tensor after the call)."""
    score = case.pool["score"].clone()
    out = impl(case.q, case.pool["k_pages"], case.pool["v_pages"], case.page_table, case.seq_lens,
               **op_kwargs(case, score=score, **flags))
    return out, score


def dense_oracle(case: Case, *, mode: str, alibi: bool, k_scale: bool, v_scale: bool, mask: bool,
                 dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Attention on the dense per-sequence tensors, computed in ``dtype``.

    Returns out [B, Hq, D] and, per sequence, the new scores [n, Hkv] (float64; only when dtype is f64).
    The output goes through ``scaled_dot_product_attention``; the score update is spelled out by hand.
    """
    d = case.dense
    batch, n_q_heads, head_dim = case.q.shape
    n_kv_heads, group = n_q_heads // case.group, case.group
    scale = head_dim ** -0.5
    out = torch.zeros(batch, n_q_heads, head_dim, dtype=dtype)
    new_scores = []
    for b, n in enumerate(case.lens):
        k = d["k_pages"][b, :n].to(dtype)  # [n, Hkv, D]
        v = d["v_pages"][b, :n].to(dtype)
        if k_scale:
            k = k * d["k_scale"][b, :n, :, None].to(dtype)
        if v_scale:
            v = v * d["v_scale"][b, :n, :, None].to(dtype)
        visible = torch.ones(n, n_kv_heads, dtype=torch.bool)
        if mask:
            visible = (d["slot_mask"][b, :n] & MASK_BIT) != 0
        bias = torch.zeros(n_q_heads, n, dtype=dtype)
        if alibi:
            rel = (d["slot_pos"][b, :n] - case.q_pos[b].cpu()).to(dtype)  # [n, Hkv]
            bias = case.slopes.cpu().to(dtype)[:, None] * rel.repeat_interleave(group, 1).T
        visible_q = visible.repeat_interleave(group, 1).T  # [Hq, n]
        bias = bias.masked_fill(~visible_q, float("-inf"))
        if n > 0:
            o = F.scaled_dot_product_attention(
                case.q[b].cpu().to(dtype)[None, :, None, :], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                attn_mask=bias[None, :, None, :], scale=scale, enable_gqa=True)[0, :, 0]  # [Hq, D]
            out[b] = torch.where(visible_q.any(1, keepdim=True), o, torch.zeros_like(o))
        if dtype != torch.float64 or n == 0:
            new_scores.append(d["score"][b, :n].double())
            continue
        x = scale * torch.einsum("hd,nhd->hn", case.q[b].cpu().double(), k.repeat_interleave(group, 1)) + bias
        if mode == "gumbel":
            x = (x + case.noise[b, :, :n].cpu().double()) / case.temperature.cpu().double()
        w = torch.where(visible_q, torch.exp(x - x.amax(1, keepdim=True)), torch.zeros_like(x))
        p = w / w.sum(1, keepdim=True).clamp_min(1e-300)  # [Hq, n]
        c = p.view(n_kv_heads, group, n).mean(1).T  # [n, Hkv]
        old = d["score"][b, :n].double()
        new = {"none": old, "accumulate": old + c, "gumbel": old + c, "decay": DECAY * old + c, "replace": c,
               "count_low": old - (c < 1.0 / visible.sum(0).clamp_min(1)).double()}[mode]
        new_scores.append(torch.where(visible, new, old))
    return out, new_scores


def pool_scores_per_seq(case: Case, score: torch.Tensor) -> list[torch.Tensor]:
    """Gather each sequence's valid scores from the pool: [n, Hkv] per sequence."""
    S = case.page_size
    res = []
    for b, n in enumerate(case.lens):
        slots = torch.arange(n)
        res.append(score.cpu()[case.page_table[b, slots // S].cpu().long(), slots % S])
    return res


def valid_slot_mask(case: Case) -> torch.Tensor:
    """[P, S] bool: slots owned by some sequence and below its length."""
    S = case.page_size
    valid = torch.zeros(case.pool["score"].shape[:2], dtype=torch.bool)
    for b, n in enumerate(case.lens):
        slots = torch.arange(n)
        valid[case.page_table[b, slots // S].cpu().long(), slots % S] = True
    return valid


@st.composite
def case_params(draw, dtypes=(torch.float32,), max_group=8):
    S = draw(st.sampled_from([4, 8, 16]))
    n_seqs = draw(st.integers(1, 3))
    # Lengths at and across page boundaries, plus 0 and 1.
    edge = st.sampled_from([0, 1, S - 1, S, S + 1, 2 * S, 2 * S + 1])
    lens = draw(st.lists(st.one_of(edge, st.integers(0, 3 * S)), min_size=n_seqs, max_size=n_seqs))
    return dict(
        seed=draw(st.integers(0, 2**16)), lens=lens, page_size=S,
        n_kv_heads=draw(st.sampled_from([1, 2])),
        group=draw(st.sampled_from([g for g in (1, 2, 4, 8) if g <= max_group])),
        head_dim=draw(st.sampled_from([32, 64, 96, 128])),
        dtype=draw(st.sampled_from(list(dtypes))),
    )


flag_st = st.fixed_dictionaries(dict(
    mode=st.sampled_from(SCORE_MODES), alibi=st.booleans(), k_scale=st.booleans(), v_scale=st.booleans(),
    mask=st.booleans()))


def assert_scores_close(case, got_pool, want_per_seq, *, atol, mode):
    got = pool_scores_per_seq(case, got_pool)
    before = pool_scores_per_seq(case, case.pool["score"])
    for g, w, old in zip(got, want_per_seq, before):
        if mode == "count_low":  # the decrement is 0 or 1 and must match exactly (ties at 1/n: measure zero)
            assert torch.equal(torch.round(old.double() - g.double()), torch.round(old.double() - w))
        else:
            torch.testing.assert_close(g.double(), w, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# (1) The reference against the dense oracle.


@given(params=case_params(), flags=flag_st)
def test_ref_matches_dense_oracle(params, flags):
    case = make_case(**params, device=torch.device("cpu"))
    out, score = run(paged_decode_attention_ref, case, **flags)
    want_out, want_scores = dense_oracle(case, **flags)
    # float32 against float64: an output is a weighted sum of values up to ~4 in size, so its rounding
    # reaches a few float32 ulps of 4 (2.6e-6 seen at 33 slots with ALiBi); a wrong slot costs ~0.1.
    torch.testing.assert_close(out.double(), want_out, atol=1e-5, rtol=1e-5)
    assert_scores_close(case, score, want_scores, atol=2e-6, mode=flags["mode"])
    untouched = ~valid_slot_mask(case)
    assert torch.equal(score.cpu()[untouched], case.pool["score"].cpu()[untouched])


def test_zero_length_gives_zero_rows_and_no_update():
    case = make_case(0, [0, 5, 0], page_size=4, n_kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
                     device=torch.device("cpu"))
    out, score = run(paged_decode_attention_ref, case, mode="accumulate", alibi=False, k_scale=False,
                     v_scale=False, mask=False)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[1].abs().sum() > 0
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------------------
# (2) The vectorised torch path (the op's CPU branch) and Triton (interpreter on CPU, compiled on GPU)
#     against the reference.


@given(params=case_params(dtypes=(torch.float32, torch.float16)), flags=flag_st)
def test_torch_path_matches_reference(params, flags):
    case = make_case(**params, device=torch.device("cpu"))  # NaN in every unused slot, as before
    out, score = run(paged_decode_attention_torch, case, **flags)
    ref_out, ref_score = run(paged_decode_attention_ref, case, **flags)
    # Both compute in fp32 and round once to the output dtype; only the summation order differs.
    atol = 1e-5 if params["dtype"] == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref_out, atol=atol, rtol=0)
    assert_scores_close(case, score, [s.double() for s in pool_scores_per_seq(case, ref_score)], atol=2e-6,
                        mode=flags["mode"])
    untouched = ~valid_slot_mask(case)
    assert torch.equal(score[untouched], case.pool["score"][untouched])
    if params["dtype"] == torch.float32:
        truth, want_scores = dense_oracle(case, **flags)
        torch.testing.assert_close(out.double(), truth, atol=2e-6, rtol=1e-5)
        assert_scores_close(case, score, want_scores, atol=2e-6, mode=flags["mode"])


def test_torch_path_reads_only_valid_pages():
    """Unused table entries (-1, or a page of another sequence) and the tail of a last page are never used."""
    case = make_case(11, [1, 16, 5], page_size=4, n_kv_heads=2, group=3, head_dim=32, dtype=torch.float32,
                     device=torch.device("cpu"))
    flags = dict(mode="accumulate", alibi=True, k_scale=True, v_scale=True, mask=False)
    want_out, want_score = run(paged_decode_attention_ref, case, **flags)
    truth, truth_scores = dense_oracle(case, **flags)  # float64
    case.page_table[0, 1:] = case.page_table[1, 0]  # row 0 holds 1 slot: its other entries are unused
    out, score = run(paged_decode_attention_torch, case, **flags)
    # Both are fp32 torch with different summation orders: within twice the reference's own f64 error.
    assert_within(out, truth, want_out, torch.float32)
    for got, want, exact in zip(pool_scores_per_seq(case, score), pool_scores_per_seq(case, want_score),
                                truth_scores):
        assert_within(got, exact, want, torch.float32)
    untouched = ~valid_slot_mask(case)
    assert torch.equal(score[untouched], want_score[untouched])

_ATOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.interpret
@given(params=case_params(dtypes=KERNEL_DTYPES), flags=flag_st, num_splits=st.sampled_from([0, 1, 2, 3]))
def test_triton_matches_reference(params, flags, num_splits):
    case = make_case(**params)
    out, score = run(paged_decode_attention_triton, case, num_splits=num_splits, **flags)
    ref_out, ref_score = run(paged_decode_attention_ref, case, **flags)

    # Output: kernel error <= 2x the error of plain torch at the same precision (+ a floor for rounding).
    truth, want_scores = dense_oracle(case, **flags)
    plain, _ = dense_oracle(case, dtype=params["dtype"], **flags)
    plain_err = (plain.double() - truth).abs().max().item() if truth.numel() else 0.0
    kernel_err = (out.cpu().double() - truth).abs().max().item() if truth.numel() else 0.0
    assert kernel_err <= 2 * plain_err + _ATOL[params["dtype"]], (kernel_err, plain_err)
    torch.testing.assert_close(out, ref_out, atol=_ATOL[params["dtype"]] + 2 * plain_err, rtol=0)

    # Scores are fp32 math on the same logits in both, so they agree closely with the reference.
    ref_scores = [s.double() for s in pool_scores_per_seq(case, ref_score)]
    atol = 2e-5 if params["dtype"] == torch.float32 else 2e-4
    assert_scores_close(case, score, ref_scores, atol=atol, mode=flags["mode"])
    untouched = ~valid_slot_mask(case)
    assert torch.equal(score.cpu()[untouched], case.pool["score"].cpu()[untouched])
    if params["dtype"] == torch.float32:  # at fp32 the kernel's scores also match the f64 oracle
        assert_scores_close(case, score, want_scores, atol=2e-5, mode=flags["mode"])


@pytest.mark.interpret
@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_each_mode_on_both_paths(mode, num_splits):
    """Every score mode through the one-program path (``num_splits=1``: output and score update in one
    launch) and the split-K path (partials, then the reduce kernel), on ragged lengths with 0, 1 and page
    boundaries, GQA, ALiBi, MiniCache restore and a slot mask, against the reference."""
    case = make_case(7, [0, 1, 8, 17, 40], page_size=8, n_kv_heads=2, group=4, head_dim=32,
                     dtype=torch.float32)
    flags = dict(mode=mode, alibi=True, k_scale=True, v_scale=True, mask=True)
    out, score = run(paged_decode_attention_triton, case, num_splits=num_splits, **flags)
    ref_out, ref_score = run(paged_decode_attention_ref, case, **flags)
    torch.testing.assert_close(out.cpu(), ref_out.cpu(), atol=1e-5, rtol=0)
    ref_scores = [s.double() for s in pool_scores_per_seq(case, ref_score)]
    assert_scores_close(case, score, ref_scores, atol=2e-5, mode=mode)
    untouched = ~valid_slot_mask(case)
    assert torch.equal(score.cpu()[untouched], case.pool["score"].cpu()[untouched])


@pytest.mark.gpu
def test_triton_bf16_long_context_split_k():
    case = make_case(3, [0, 1, 700, 4096], page_size=16, n_kv_heads=8, group=4, head_dim=128,
                     dtype=torch.bfloat16)
    flags = dict(mode="gumbel", alibi=True, k_scale=True, v_scale=True, mask=True)
    truth, want_scores = dense_oracle(case, **flags)
    plain, _ = dense_oracle(case, dtype=torch.bfloat16, **flags)
    plain_err = (plain.double() - truth).abs().max().item()
    for num_splits in (0, 1, 7):
        out, score = run(paged_decode_attention_triton, case, num_splits=num_splits, **flags)
        assert (out.cpu().double() - truth).abs().max().item() <= 2 * plain_err + _ATOL[torch.bfloat16]
        assert_scores_close(case, score, want_scores, atol=1e-3, mode="gumbel")


# ---------------------------------------------------------------------------------------------------------
# (3) Properties of the fused score update.


@pytest.mark.parametrize("impl", [paged_decode_attention_ref, paged_decode_attention_torch,
                                  paged_decode_attention_triton], ids=["ref", "torch", "triton"])
@given(params=case_params(max_group=4), mask=st.booleans(), num_splits=st.sampled_from([1, 2]))
def test_accumulate_adds_unit_mass_per_kv_head(impl, params, mask, num_splits):
    case = make_case(**params)
    kw = dict(mode="accumulate", alibi=False, k_scale=False, v_scale=False, mask=mask)
    if impl is paged_decode_attention_triton:
        kw["num_splits"] = num_splits
    _, score = run(impl, case, **kw)
    delta = (score - case.pool["score"]).cpu()
    before = [s for s in pool_scores_per_seq(case, case.pool["score"])]
    after = pool_scores_per_seq(case, score)
    for b, n in enumerate(case.lens):
        visible = torch.ones(n, delta.shape[2], dtype=torch.bool)
        if mask:
            visible = (case.dense["slot_mask"][b, :n] & MASK_BIT) != 0
        added = (after[b] - before[b]).sum(0)  # [Hkv]
        want = visible.any(0).float()  # 1 per KV head with anything visible, else 0
        torch.testing.assert_close(added, want, atol=1e-5, rtol=0)
        assert torch.equal(after[b][~visible], before[b][~visible])  # hidden slots untouched
        assert (after[b][visible] >= before[b][visible]).all()
    untouched = ~valid_slot_mask(case)
    assert torch.equal(delta[untouched], torch.zeros_like(delta[untouched]))  # other pages, other sequences


# ---------------------------------------------------------------------------------------------------------
# (4) Bad input: a clear error naming the argument or the bundle field; nothing written.


def _set_page(row, col, value):
    def change(a):
        table = a["page_table"].clone()
        table[row, col] = value if value is not None else a["k_pages"].shape[0]
        return {"page_table": table}
    return change


def _scores(change):
    """Replace fields of the valid ``scores`` bundle: ``change(scores) -> {field: value}``."""
    return lambda a: {"scores": a["scores"]._replace(**change(a["scores"]))}


def _slots(a) -> tuple[int, ...]:
    return tuple(a["scores"].score.shape)  # [P, S, Hkv]


# (id, changes computed from the valid arguments, error type, text the message must contain)
BAD_INPUTS = [
    ("q_dtype", lambda a: {"q": a["q"].to(torch.int32)}, TypeError, "q has dtype"),
    ("k_dtype", lambda a: {"k_pages": a["k_pages"].half()}, TypeError, "k_pages has dtype"),
    ("v_device", lambda a: {"v_pages": a["v_pages"].to("meta")}, ValueError, "v_pages is on meta"),
    ("k_noncontig", lambda a: {"k_pages": a["k_pages"].transpose(2, 3).contiguous().transpose(2, 3)},
     ValueError, "k_pages must be contiguous"),
    ("v_shape", lambda a: {"v_pages": a["v_pages"][:-1].contiguous()}, ValueError, "v_pages must have"),
    ("head_dim", lambda a: {"q": a["q"][..., :16].contiguous()}, ValueError, "head dim"),
    ("heads", lambda a: {"q": a["q"][:, :3].contiguous()}, ValueError, "not a multiple of the 2 KV"),
    ("table_batch", lambda a: {"page_table": a["page_table"][:1].contiguous()}, ValueError,
     "page_table must have"),
    ("table_dtype", lambda a: {"page_table": a["page_table"].long()}, TypeError, "page_table has dtype"),
    ("page_outside", _set_page(1, 0, None), ValueError, r"page_table\[1, 0\]=\d+ points outside"),
    ("page_negative", _set_page(1, 1, -1), ValueError, r"page_table\[1, 1\]=-1"),
    ("lens_negative", lambda a: {"seq_lens": torch.tensor([3, -1], dtype=torch.int32)}, ValueError,
     "seq_lens must be >= 0"),
    ("lens_too_long", lambda a: {"seq_lens": torch.tensor([3, 99], dtype=torch.int32)}, ValueError,
     r"seq_lens\[1\]=99"),
    ("lens_not_tensor", lambda a: {"seq_lens": [3, 5]}, TypeError, "seq_lens must be a torch.Tensor"),
    ("score_dtype", _scores(lambda s: {"score": s.score.double()}), TypeError, r"scores\.score has dtype"),
    ("score_missing", _scores(lambda s: {"score": None}), ValueError, r"pass scores\.score"),
    ("mode", _scores(lambda s: {"mode": "h2o"}), ValueError, r"scores\.mode='h2o'"),
    ("gumbel_no_key", _scores(lambda s: {"mode": "gumbel"}), ValueError, r"needs scores\.gumbel_key"),
    ("key_shape", _scores(lambda s: {"mode": "gumbel", "gumbel_key": torch.zeros(2, 3, dtype=torch.int32)}),
     ValueError, r"scores\.gumbel_key must have shape"),
    ("key_dtype", _scores(lambda s: {"mode": "gumbel", "gumbel_key": torch.zeros(2, 4)}), TypeError,
     r"scores\.gumbel_key has dtype"),
    ("temperature", _scores(lambda s: {"temperature": torch.ones(2)}), ValueError,
     r"scores\.temperature must have"),
    ("alibi_no_pos", lambda a: {"alibi": Alibi(torch.ones(4), None, None)}, ValueError, r"alibi\.slot_pos"),
    ("alibi_shape", lambda a: {"alibi": Alibi(torch.ones(3), torch.zeros(_slots(a), dtype=torch.int32),
                                              torch.zeros(2, dtype=torch.int32))},
     ValueError, r"alibi\.slopes must have"),
    ("mask_dtype", lambda a: {"restore": Restore(slot_mask=torch.ones(_slots(a), dtype=torch.bool))},
     TypeError, r"restore\.slot_mask has dtype"),
    ("k_scale_shape", lambda a: {"restore": Restore(k_scale=torch.ones(1, 1, 1))}, ValueError,
     r"restore\.k_scale must have"),
    ("mask_bit", lambda a: {"restore": Restore(mask_bit=256)}, ValueError, r"restore\.mask_bit"),
    ("num_splits", lambda a: {"num_splits": -1}, ValueError, "num_splits"),
    # The bundles' own checks.
    ("alibi_slot_pos_shape", lambda a: {"alibi": Alibi(torch.ones(4), torch.zeros(1, 1, 1, dtype=torch.int32),
                                                       torch.zeros(2, dtype=torch.int32))},
     ValueError, r"alibi\.slot_pos must have"),
    ("alibi_q_pos_dtype", lambda a: {"alibi": Alibi(torch.ones(4), torch.zeros(_slots(a), dtype=torch.int32),
                                                    torch.zeros(2, dtype=torch.int64))},
     TypeError, r"alibi\.q_pos has dtype"),
    ("alibi_not_bundle", lambda a: {"alibi": torch.ones(4)}, TypeError, r"alibi must be a kvkernels\.Alibi"),
    ("scores_not_bundle", lambda a: {"scores": a["scores"].score}, TypeError,
     r"scores must be a kvkernels\.ScoreUpdate"),
    ("restore_not_bundle", lambda a: {"restore": (None, None, None, 1)}, TypeError,
     r"restore must be a kvkernels\.Restore"),
]


@pytest.mark.parametrize("name,change,exc,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_rejected_before_writing(name, change, exc, match):
    case = make_case(1, [3, 5], page_size=4, n_kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
                     device=torch.device("cpu"))
    score = case.pool["score"].clone()
    args = dict(q=case.q, k_pages=case.pool["k_pages"], v_pages=case.pool["v_pages"],
                page_table=case.page_table, seq_lens=case.seq_lens, scale=0.1,
                scores=ScoreUpdate(score, "accumulate"))
    args.update(change(args))
    with pytest.raises(exc, match=match):
        paged_decode_attention(**args)
    assert torch.equal(score, case.pool["score"])


# ---------------------------------------------------------------------------------------------------------
# (5) The public op: CPU dispatch, opcheck, torch.compile.


def _op_args(case, score):
    kw = op_kwargs(case, mode="gumbel", alibi=True, k_scale=True, v_scale=False, mask=True, score=score)
    return (case.q, case.pool["k_pages"], case.pool["v_pages"], case.page_table, case.seq_lens), kw


def test_public_op_on_cpu_runs_torch_path_and_mutates_score():
    case = make_case(5, [0, 9, 17], page_size=8, n_kv_heads=2, group=4, head_dim=32, dtype=torch.float32,
                     device=torch.device("cpu"))
    s_op, s_ref = case.pool["score"].clone(), case.pool["score"].clone()
    args, kw = _op_args(case, s_op)
    out = paged_decode_attention(*args, **kw)
    args, kw = _op_args(case, s_ref)
    assert torch.equal(out, paged_decode_attention_torch(*args, **kw))
    assert torch.equal(s_op, s_ref) and not torch.equal(s_op, case.pool["score"])


def _flat(kw: dict) -> dict:
    """The registered op's flat keyword arguments for the public op's ``kw`` (ALiBi and scores given): an op
    schema takes no NamedTuple, so the public op passes the bundles field by field."""
    alibi, scores, restore = kw["alibi"], kw["scores"], kw["restore"] or Restore()
    return dict(scale=kw["scale"], alibi_slopes=alibi.slopes, slot_pos=alibi.slot_pos, q_pos=alibi.q_pos,
                score=scores.score, score_mode=scores.mode, decay=scores.decay,
                gumbel_key=scores.gumbel_key, temperature=scores.temperature, k_scale=restore.k_scale,
                v_scale=restore.v_scale, slot_mask=restore.slot_mask, mask_bit=restore.mask_bit,
                num_splits=kw["num_splits"])


def test_opcheck():
    case = make_case(6, [2, 9], page_size=4, n_kv_heads=1, group=2, head_dim=32, dtype=torch.float32,
                     device=torch.device("cpu"))
    args, kw = _op_args(case, case.pool["score"].clone())
    torch.library.opcheck(_paged_decode_attention_op, args, _flat(kw),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.slow
@pytest.mark.parametrize("scored", [True, False], ids=["gumbel", "no-score"])
def test_compile_fullgraph_matches_eager(scored):
    """Also without a score tensor (scores=None: the full cache), which inductor once failed to lower. The
    ScoreUpdate bundle is built inside the compiled function, as the models' decode step builds it."""
    case = make_case(7, [0, 6, 13], page_size=4, n_kv_heads=2, group=2, head_dim=32, dtype=torch.float32,
                     device=torch.device("cpu"))

    def step(q, k_pages, v_pages, page_table, seq_lens, score, key, tau):
        scores = ScoreUpdate(score, "gumbel", gumbel_key=key, temperature=tau) if scored else None
        out = paged_decode_attention(q, k_pages, v_pages, page_table, seq_lens, scale=0.2, scores=scores)
        return out * 2.0

    def args(score):
        return (case.q, case.pool["k_pages"], case.pool["v_pages"], case.page_table, case.seq_lens, score,
                case.noise_key, case.temperature)

    s_eager, s_comp = case.pool["score"].clone(), case.pool["score"].clone()
    compiled = torch.compile(step, fullgraph=True, backend="inductor")
    want = step(*args(s_eager))
    got = compiled(*args(s_comp))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(s_comp, s_eager)
    assert torch.equal(s_comp, case.pool["score"]) != scored  # written only when scoring


def test_ops_that_mutate_have_no_defaulted_arguments():
    """torch < 2.13 drops trailing arguments equal to their defaults before bumping a mutated argument's
    version by position (IndexError for an eager decode without scores, torch 2.11 on an H200): an op that
    mutates declares every argument without a default."""
    import kvkernels  # noqa: F401  (registers the ops)

    for name in ("paged_decode_attention", "topk_compact", "topk_evict"):
        schema = getattr(torch.ops.kvkernels, name).default._schema
        assert any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments), name
        defaulted = [a.name for a in schema.arguments if a.has_default_value()]
        assert not defaulted, f"{name}: {defaulted}"
