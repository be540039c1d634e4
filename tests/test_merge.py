"""magnitude_direction_merge / merge_restore (docs/contract.md §2.5): the reference against a per-token
float64 oracle written here, the Triton launcher (interpreter) against the reference, and the restore
error bound.

Bound (exact SLERP): ``e`` lies on the great circle through ``u_a`` and ``u_b`` at angle ``t * theta``
from ``u_a`` and ``(1 - t) * theta`` from ``u_b``, and restoring keeps the original length, so
``||merge_restore(e, r_a) - x_a|| / r_a = 2 sin(t * theta / 2)`` (b: ``2 sin((1 - t) * theta / 2)``).
Every token left merged has ``theta <= theta*``, the smallest retained angle of its head, so its error is
at most ``2 sin(max(t, 1 - t) * theta* / 2) <= max(t, 1 - t) * theta*`` (``theta* / 2`` at ``t = 0.5``);
retained tokens are stored as originals by the caller and come back exact.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from devices import DEVICE, on_device
from kvkernels.merge import (
    SLERP_EPS,
    magnitude_direction_merge,
    magnitude_direction_merge_ref,
    magnitude_direction_merge_triton,
    merge_restore,
)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3}  # fp16: the direction is rounded to fp16 on output


def oracle(x_a: torch.Tensor, x_b: torch.Tensor, t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token float64 MiniCache formulas with math functions: (direction [N, H, D], theta [N, H])."""
    n_tok, n_heads, dim = x_a.shape
    direction = torch.zeros(n_tok, n_heads, dim, dtype=torch.float64)
    theta = torch.zeros(n_tok, n_heads, dtype=torch.float64)
    for i in range(n_tok):
        for h in range(n_heads):
            a, b = x_a[i, h].double().tolist(), x_b[i, h].double().tolist()
            ra, rb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
            if ra == 0 and rb == 0:
                continue
            ua = [x / ra for x in a] if ra else [x / rb for x in b]
            ub = [x / rb for x in b] if rb else ua
            th = math.acos(max(-1.0, min(1.0, sum(p * q for p, q in zip(ua, ub))))) if ra and rb else 0.0
            if math.sin(th) >= SLERP_EPS:
                ca, cb = math.sin((1 - t) * th) / math.sin(th), math.sin(t * th) / math.sin(th)
                e = [ca * p + cb * q for p, q in zip(ua, ub)]
            else:
                e = [(1 - t) * p + t * q for p, q in zip(ua, ub)]
                n = math.sqrt(sum(x * x for x in e))
                e = [x / n for x in e] if n > 1e-12 else ua
            direction[i, h] = torch.tensor(e, dtype=torch.float64)
            theta[i, h] = th
    return direction, theta


def angle(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Angle between the last-dim vectors, well conditioned near 0 (float64)."""
    x, y = x.double(), y.double()
    x = x / x.norm(dim=-1, keepdim=True)
    y = y / y.norm(dim=-1, keepdim=True)
    return 2 * torch.atan2((x - y).norm(dim=-1), (x + y).norm(dim=-1))


def assert_valid_retention(retained: torch.Tensor, theta: torch.Tensor, ratio: float, tol: float) -> None:
    """Per head: the right count, and no left-out token has a clearly larger angle than a retained one."""
    n_tok = theta.shape[0]
    k = min(n_tok, math.ceil(round(ratio * n_tok, 9)))
    assert (retained.sum(0) == k).all()
    for h in range(theta.shape[1]):
        kept, left = theta[retained[:, h], h], theta[~retained[:, h], h]
        if kept.numel() and left.numel():
            assert kept.min() >= left.max() - tol


@st.composite
def pairs(draw):
    """x_a, x_b [N, H, D] with zero vectors, parallel, antipodal and tied tokens mixed in."""
    n_tok, n_heads = draw(st.integers(0, 12)), draw(st.integers(1, 3))
    dim = draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    x_a = torch.randn(n_tok, n_heads, dim, generator=g) * draw(st.sampled_from([1e-2, 1.0, 30.0]))
    x_b = x_a * draw(st.sampled_from([0.0, 0.3, 1.0])) + torch.randn(n_tok, n_heads, dim, generator=g)
    for i in range(n_tok):  # special tokens
        kind = draw(st.sampled_from(["plain"] * 4 + ["a0", "b0", "both0", "parallel", "antipodal", "copy"]))
        if kind in ("a0", "both0"):
            x_a[i] = 0
        if kind in ("b0", "both0"):
            x_b[i] = 0
        if kind == "parallel":
            x_b[i] = 2 * x_a[i]
        if kind == "antipodal":
            x_b[i] = -x_a[i]
        if kind == "copy" and i:
            x_a[i], x_b[i] = x_a[i - 1], x_b[i - 1]
    t = draw(st.sampled_from([0.0, 0.25, 0.5, 0.6, 1.0]))
    ratio = draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    return x_a.to(dtype), x_b.to(dtype), t, ratio


@given(case=pairs())
def test_reference_matches_float64_oracle(case):
    x_a, x_b, t, ratio = case
    merge = on_device(magnitude_direction_merge)
    direction, mag_a, mag_b, retained = merge(x_a, x_b, t=t, retain_ratio=ratio)
    want_dir, want_theta = oracle(x_a, x_b, t)
    assert direction.dtype == x_a.dtype and mag_a.dtype == torch.float32 and retained.dtype == torch.bool
    # Away from exact antipodes (direction there is ill-conditioned and such tokens are retained anyway).
    ok = want_theta < math.pi - 1e-2
    assert torch.allclose(direction.double()[ok], want_dir[ok], atol=TOL[x_a.dtype])
    assert torch.allclose(mag_a, x_a.double().norm(dim=-1).float(), rtol=1e-5)
    assert torch.allclose(mag_b, x_b.double().norm(dim=-1).float(), rtol=1e-5)
    # theta from an fp32 dot product is only ~sqrt(eps) accurate near 0: compare rankings with that slack.
    assert_valid_retention(retained, want_theta, ratio, tol=2e-3)


# A random draw of pairs() (pi - theta = 0.024, t = 0.6): the SLERP direction, not renormalised then, had norm
# 1 - 1.4e-4, so the restored vector missed the stored length by as much (kvkernels.merge's docstring).
NEAR_ANTIPODAL = (torch.tensor([[[-0.012664919719099998, 0.009722408838570118, 0.004311293363571167]]]),
                  torch.tensor([[[1.905740737915039, -1.5014015436172485, -0.7087899446487427]]]), 0.6, 0.0)


@pytest.mark.interpret
@given(case=pairs())
@example(case=NEAR_ANTIPODAL)
def test_triton_launcher_matches_reference(case):
    x_a, x_b, t, ratio = case
    ref = magnitude_direction_merge_ref(x_a, x_b, t=t, retain_ratio=ratio)
    tri = on_device(magnitude_direction_merge_triton)(x_a, x_b, t=t, retain_ratio=ratio)
    _, theta = oracle(x_a, x_b, t)
    ok = theta < math.pi - 1e-2
    assert tri[0].dtype == x_a.dtype
    assert torch.allclose(tri[0].double()[ok], ref[0].double()[ok], atol=TOL[x_a.dtype])
    assert torch.allclose(tri[1], ref[1], rtol=1e-5) and torch.allclose(tri[2], ref[2], rtol=1e-5)
    assert_valid_retention(tri[3], theta, ratio, tol=2e-3)


@given(case=pairs())
@example(case=NEAR_ANTIPODAL)
def test_restore_error_bound_and_retained_exact(case):
    x_a, x_b, t, ratio = case
    x_a, x_b = x_a.float(), x_b.float()  # the bound is about the maths; fp16 rounding is the tests above
    direction, mag_a, mag_b, retained = magnitude_direction_merge(x_a, x_b, t=t, retain_ratio=ratio)
    _, theta = oracle(x_a, x_b, t)
    for x, mag, w in ((x_a, mag_a, t), (x_b, mag_b, 1 - t)):
        restored = merge_restore(direction, mag)
        # What the caller reads back: originals for retained tokens, the merged form for the rest.
        read = torch.where(retained[..., None], x, restored)
        assert torch.equal(read[retained], x[retained])
        nonzero = (mag > 0) & (theta < math.pi - 1e-2)
        assert torch.allclose(restored.norm(dim=-1)[nonzero], mag[nonzero], rtol=1e-5)
        # Exact SLERP geometry: the restored vector sits at angle w * theta from the original.
        assert torch.allclose(angle(restored, x)[nonzero], w * theta[nonzero], atol=2e-3)
        rel_err = (read - x).double().norm(dim=-1) / mag.double().clamp_min(1e-30)  # [N, H]
        for h in range(x.shape[1]):
            if retained[:, h].any() and (~retained[:, h] & nonzero[:, h]).any():
                theta_star = theta[retained[:, h], h].min()
                bound = 2 * math.sin(max(t, 1 - t) * float(theta_star) / 2) + 2e-3
                assert rel_err[~retained[:, h] & nonzero[:, h], h].max() <= bound


@pytest.mark.parametrize("impl", [magnitude_direction_merge, pytest.param(magnitude_direction_merge_triton,
                                                                          marks=pytest.mark.interpret)])
def test_endpoints_zero_vectors_and_tiny_n(impl):
    impl = on_device(impl)
    g = torch.Generator().manual_seed(0)
    x_a, x_b = torch.randn(5, 2, 8, generator=g), torch.randn(5, 2, 8, generator=g)
    u_a = x_a / x_a.norm(dim=-1, keepdim=True)
    u_b = x_b / x_b.norm(dim=-1, keepdim=True)
    assert torch.allclose(impl(x_a, x_b, t=0.0)[0], u_a, atol=1e-6)
    assert torch.allclose(impl(x_a, x_b, t=1.0)[0], u_b, atol=1e-6)

    x_a[1, 0] = 0
    x_a[2, 1] = 0
    x_b[2, 1] = 0
    direction, mag_a, mag_b, retained = impl(x_a, x_b, t=0.5, retain_ratio=1 / 5)
    assert torch.allclose(direction[1, 0], u_b[1, 0], atol=1e-6) and mag_a[1, 0] == 0
    assert (direction[2, 1] == 0).all() and mag_a[2, 1] == 0 and mag_b[2, 1] == 0
    assert not retained[1, 0] and not retained[2, 1]  # restoring a zero vector is exact: theta = 0

    for n_tok in (0, 1):
        direction, mag_a, mag_b, retained = impl(x_a[:n_tok].clone(), x_b[:n_tok].clone(), retain_ratio=0.05)
        assert direction.shape == (n_tok, 2, 8) and mag_a.shape == mag_b.shape == retained.shape == (n_tok, 2)
        assert retained.sum() == 2 * n_tok  # ceil(0.05 * 1) = 1 token per head


@pytest.mark.parametrize("impl", [magnitude_direction_merge, pytest.param(magnitude_direction_merge_triton,
                                                                          marks=pytest.mark.interpret)])
def test_retention_ties_go_to_the_lower_index_and_count_is_exact(impl):
    impl = on_device(impl)
    row_a, row_b = torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.6, 0.8, 0.0])
    x_a, x_b = row_a.repeat(100, 1, 1), row_b.repeat(100, 1, 1)  # 100 identical tokens, 1 head
    retained = impl(x_a, x_b, retain_ratio=0.07)[3]
    assert retained[:, 0].nonzero().flatten().tolist() == list(range(7))  # 0.07 * 100 -> 7, not 8
    x_b[40, 0] = torch.tensor([0.0, 1.0, 0.0])  # the single largest angle
    assert impl(x_a, x_b, retain_ratio=0.01)[3][:, 0].nonzero().flatten().tolist() == [40]


@pytest.mark.parametrize("x_a, x_b, kwargs, error, match", [
    (torch.zeros(2, 1, 4), torch.zeros(2, 1, 5), {}, ValueError, "x_b must have shape \\[2, 1, 4\\]"),
    (torch.zeros(2, 4), torch.zeros(2, 4), {}, ValueError, "x_a must have 3 dimensions"),
    (torch.zeros(2, 1, 4), torch.zeros(2, 1, 4, dtype=torch.float16), {}, TypeError, "x_b has dtype float16"),
    (torch.zeros(2, 1, 4).to(torch.int8), torch.zeros(2, 1, 4).to(torch.int8), {}, TypeError, "x_a has"),
    (torch.zeros(2, 1, 4), torch.zeros(2, 1, 4, device="meta"), {}, ValueError, "x_b is on meta"),
    (torch.zeros(4, 1, 2).transpose(0, 2), torch.zeros(2, 1, 4), {}, ValueError, "x_a must be contiguous"),
    (torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), dict(t=1.5), ValueError, "t=1.5 must be in \\[0, 1\\]"),
    (torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), dict(retain_ratio=-0.1), ValueError, "retain_ratio=-0.1"),
])
def test_bad_input(x_a, x_b, kwargs, error, match):
    x_a, x_b = (x if x.device.type == "meta" else x.to(DEVICE) for x in (x_a, x_b))
    with pytest.raises(error, match=match):
        magnitude_direction_merge(x_a, x_b, **kwargs)


def test_restore_checks_shapes():
    with pytest.raises(ValueError, match="mag must have shape \\[3, 2\\]"):
        merge_restore(torch.zeros(3, 2, 4), torch.zeros(3, 4))


def test_compiles_without_graph_breaks():
    x_a, x_b = torch.randn(6, 2, 8, device=DEVICE), torch.randn(6, 2, 8, device=DEVICE)
    fn = lambda a, b: magnitude_direction_merge(a, b, t=0.3, retain_ratio=0.2)
    for got, want in zip(torch.compile(fn, fullgraph=True, backend="aot_eager")(x_a, x_b), fn(x_a, x_b)):
        assert torch.equal(got, want)
