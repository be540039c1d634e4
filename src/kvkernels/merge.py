"""MiniCache magnitude-direction merge of two layers' K (or V) states (docs/contract.md §2.5).

Per token and head: ``r = ||x||``, ``u = x / r``, ``theta = arccos(clamp(u_a . u_b, -1, 1))`` and the
SLERP direction ``e = [sin((1 - t) theta) u_a + sin(t theta) u_b] / sin(theta)``; restoring ``e * r`` gives
a vector of the original length at angle ``t * theta`` (layer a) or ``(1 - t) * theta`` (layer b) from
the original. The tokens with the largest ``theta`` are flagged ``retained`` so the caller stores them
unmerged. All maths in float32; the direction is returned in the input dtype.

Numerics shared by the reference and the kernel (so they agree):
* ``sin(theta) < SLERP_EPS`` (vectors nearly parallel or antipodal): the lerp ``(1 - t) u_a + t u_b``,
  renormalised (``u_a`` when that lerp vanishes, i.e. exactly antipodal at ``t = 0.5``);
* the SLERP direction is renormalised too. Its unit length holds only if ``theta`` is exactly the angle
  ``phi`` between the float32 ``u_a`` and ``u_b``: ``||e||^2 - 1 = 2 s_a s_b (cos(phi) - cos(theta)) /
  sin(theta)^2`` (``s_a = sin((1 - t) theta)``, ``s_b = sin(t theta)``), so near antipodal vectors the
  float32 rounding of the dot product (~1e-7) is amplified by ``1 / sin(theta)^2``. Measured without it:
  ``| ||e|| - 1 |`` up to 3e-5 at ``pi - theta = 0.1``, 3e-3 at 0.01, 0.4 at 1e-3, and restoring missed
  the stored length by as much; with it, ~2e-7 at every angle;
* a zero vector has magnitude 0 and takes the other's direction, and its token gets ``theta = 0``
  (restoring it is exact, so it never needs retaining); two zero vectors give a zero direction.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvkernels._checks import FLOAT_DTYPES, check_shape, check_tensor
from kvkernels._triton import HAS_TRITON, covering, launch, require_triton, use_triton

SLERP_EPS = 1e-4

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _acos(x):
        # Abramowitz & Stegun 4.4.46 (|error| <= 2e-8 on [0, 1]): tl has no arccos and the interpreter
        # cannot run libdevice, so the kernel carries its own.
        ax = tl.abs(x)
        p = -0.0012624911
        p = p * ax + 0.0066700901
        p = p * ax - 0.0170881256
        p = p * ax + 0.0308918810
        p = p * ax - 0.0501743046
        p = p * ax + 0.0889789874
        p = p * ax - 0.2145988016
        p = p * ax + 1.5707963050
        r = tl.sqrt(1.0 - ax) * p
        return tl.where(x < 0, 3.141592653589793 - r, r)

    @triton.jit
    def _merge_kernel(xa_ptr, xb_ptr, dir_ptr, mag_a_ptr, mag_b_ptr, theta_ptr, n_rows, dim, t, eps,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
        """One program per BLOCK_R (token, head) rows of length ``dim`` (rows are contiguous)."""
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_D)
        row_mask = rows < n_rows
        mask = row_mask[:, None] & (cols[None, :] < dim)
        offs = rows.to(tl.int64)[:, None] * dim + cols[None, :]  # [BLOCK_R, BLOCK_D]
        xa = tl.load(xa_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        xb = tl.load(xb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        ra = tl.sqrt(tl.sum(xa * xa, axis=1))  # [BLOCK_R]
        rb = tl.sqrt(tl.sum(xb * xb, axis=1))
        a_zero = ra == 0
        b_zero = rb == 0
        ua = xa / tl.where(a_zero, 1.0, ra)[:, None]
        ub = xb / tl.where(b_zero, 1.0, rb)[:, None]
        ua = tl.where(a_zero[:, None], ub, ua)
        ub = tl.where(b_zero[:, None], ua, ub)
        cos = tl.minimum(tl.maximum(tl.sum(ua * ub, axis=1), -1.0), 1.0)
        cos = tl.where(a_zero | b_zero, 1.0, cos)
        theta = _acos(cos)
        sin_theta = tl.sin(theta)
        slerp = sin_theta >= eps
        safe_sin = tl.where(slerp, sin_theta, 1.0)
        ca = tl.where(slerp, tl.sin((1.0 - t) * theta) / safe_sin, 1.0 - t)
        cb = tl.where(slerp, tl.sin(t * theta) / safe_sin, t)
        e = ca[:, None] * ua + cb[:, None] * ub
        # Renormalised on both paths (module docstring); only a lerp can vanish (exact antipodes, t = 0.5).
        norm = tl.sqrt(tl.sum(e * e, axis=1))
        e = tl.where((norm > 0)[:, None], e / tl.where(norm > 0, norm, 1.0)[:, None], ua)
        tl.store(dir_ptr + offs, e.to(dir_ptr.dtype.element_ty), mask=mask)
        tl.store(mag_a_ptr + rows, ra, mask=row_mask)
        tl.store(mag_b_ptr + rows, rb, mask=row_mask)
        tl.store(theta_ptr + rows, theta, mask=row_mask)


def _n_retained(n_tokens: int, retain_ratio: float) -> int:
    # round() first so 0.07 * 100 = 7.000000000000001 keeps 7 tokens, not 8.
    return min(n_tokens, math.ceil(round(retain_ratio * n_tokens, 9)))


def retained_mask(theta: Tensor, retain_ratio: float) -> Tensor:
    """``[N, H]`` bool: per head, the ``ceil(retain_ratio * N)`` tokens of largest ``theta``.

    Ties go to the lower token index."""
    k = _n_retained(theta.shape[0], retain_ratio)
    # Stable descending sort keeps equal angles in token order, so the lower index wins a tie.
    top = torch.sort(theta, dim=0, descending=True, stable=True).indices[:k]  # [k, H]
    return torch.zeros_like(theta, dtype=torch.bool).scatter_(0, top, True)


# ----------------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------------

def magnitude_direction_merge_ref(x_a: Tensor, x_b: Tensor, *, t: float = 0.5,
                                  retain_ratio: float = 0.05) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pure-torch reference of :func:`magnitude_direction_merge` (same signature and results)."""
    xa, xb = x_a.float(), x_b.float()
    mag_a, mag_b = xa.norm(dim=-1), xb.norm(dim=-1)  # [N, H]
    a_zero, b_zero = (mag_a == 0)[..., None], (mag_b == 0)[..., None]  # [N, H, 1]
    u_a = xa / torch.where(a_zero, 1.0, mag_a[..., None])
    u_b = xb / torch.where(b_zero, 1.0, mag_b[..., None])
    u_a = torch.where(a_zero, u_b, u_a)  # a zero vector borrows the other's direction
    u_b = torch.where(b_zero, u_a, u_b)
    cos = (u_a * u_b).sum(-1).clamp(-1.0, 1.0)
    cos = torch.where(a_zero[..., 0] | b_zero[..., 0], 1.0, cos)
    theta = torch.acos(cos)  # [N, H]
    sin_theta = torch.sin(theta)[..., None]  # [N, H, 1]
    slerp = sin_theta >= SLERP_EPS
    th = theta[..., None]
    e_slerp = (torch.sin((1 - t) * th) / sin_theta) * u_a + (torch.sin(t * th) / sin_theta) * u_b
    e_lerp = (1 - t) * u_a + t * u_b
    direction = torch.where(slerp, e_slerp, e_lerp)
    # Renormalised on both paths (module docstring); only a lerp can vanish (exact antipodes, t = 0.5).
    norm = direction.norm(dim=-1, keepdim=True)
    direction = torch.where(norm > 0, direction / norm.clamp_min(torch.finfo(torch.float32).tiny), u_a)
    return direction.to(x_a.dtype), mag_a, mag_b, retained_mask(theta, retain_ratio)


# ----------------------------------------------------------------------------------------------------
# Triton launcher
# ----------------------------------------------------------------------------------------------------

def magnitude_direction_merge_triton(x_a: Tensor, x_b: Tensor, *, t: float = 0.5,
                                     retain_ratio: float = 0.05) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton launcher of :func:`magnitude_direction_merge` (no input checks; contiguous inputs)."""
    require_triton()
    n_tokens, n_heads, dim = x_a.shape
    n_rows = n_tokens * n_heads
    direction = torch.empty_like(x_a)
    mag_a = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=x_a.device)
    mag_b = torch.empty_like(mag_a)
    theta = torch.empty_like(mag_a)
    if n_rows:
        block_d = triton.next_power_of_2(dim)
        block_r = max(1, min(64, 4096 // block_d))
        launch(
            _merge_kernel, (triton.cdiv(n_rows, block_r),),
            x_a, x_b, direction, mag_a, mag_b, theta, n_rows, dim, float(t), SLERP_EPS,
            BLOCK_R=block_r, BLOCK_D=block_d,
        )
    return direction, mag_a, mag_b, retained_mask(theta, retain_ratio)


# ----------------------------------------------------------------------------------------------------
# Public op
# ----------------------------------------------------------------------------------------------------

@torch.library.custom_op("kvkernels::magnitude_direction_merge", mutates_args=())
def _merge_op(x_a: Tensor, x_b: Tensor, t: float,
              retain_ratio: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    impl = magnitude_direction_merge_triton if use_triton(x_a) else magnitude_direction_merge_ref
    return impl(x_a, x_b, t=t, retain_ratio=retain_ratio)


@_merge_op.register_fake
def _(x_a, x_b, t, retain_ratio):
    mag = x_a.new_empty(x_a.shape[:2], dtype=torch.float32)
    return torch.empty_like(x_a), mag, torch.empty_like(mag), mag.new_empty(mag.shape, dtype=torch.bool)


def magnitude_direction_merge(x_a: Tensor, x_b: Tensor, *, t: float = 0.5,
                              retain_ratio: float = 0.05) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Merge two layers' states into one shared unit direction plus per-layer magnitudes (MiniCache).

    Parameters
    ----------
    x_a, x_b : Tensor ``[N, H, D]`` float32 / float16 / bfloat16, contiguous, same dtype and device
        The two layers' keys (or values) for the same ``N`` tokens.
    t : float in [0, 1]
        Interpolation weight: ``t = 0`` gives ``u_a``, ``t = 1`` gives ``u_b``.
    retain_ratio : float in [0, 1]
        Fraction of tokens per head flagged ``retained`` (``ceil(retain_ratio * N)`` of them).

    Returns
    -------
    direction : Tensor ``[N, H, D]``, the input dtype
        SLERP of the unit directions (unit norm up to the dtype's rounding).
    mag_a, mag_b : Tensor ``[N, H]`` float32
        ``||x_a||`` and ``||x_b||``; ``merge_restore(direction, mag_a)`` approximates ``x_a``.
    retained : Tensor ``[N, H]`` bool
        Per head, the tokens with the largest angle ``theta`` (ties: lower index); the caller stores
        them unmerged. Every other token restores within angle ``t * theta`` (a) / ``(1 - t) * theta``
        (b) of its original, with its original length.
    """
    check_tensor("x_a", x_a, ndim=3, dtypes=FLOAT_DTYPES, contiguous=True)
    check_tensor("x_b", x_b, dtypes=(x_a.dtype,), device=x_a.device, contiguous=True)
    check_shape("x_b", x_b, x_a.shape, "same as x_a")
    if not 0.0 <= t <= 1.0:
        raise ValueError(f"t={t} must be in [0, 1] (0 keeps layer a's direction, 1 layer b's)")
    if not 0.0 <= retain_ratio <= 1.0:
        raise ValueError(f"retain_ratio={retain_ratio} must be in [0, 1] (a fraction of the tokens)")
    return torch.ops.kvkernels.magnitude_direction_merge(x_a, x_b, float(t), float(retain_ratio))


def merge_restore(direction: Tensor, mag: Tensor) -> Tensor:
    """Restore one layer's states: ``direction * mag[..., None]``, computed in float32.

    direction ``[N, H, D]`` (any float dtype), mag ``[N, H]`` float32 -> ``[N, H, D]`` in direction's dtype.
    """
    check_tensor("direction", direction, dtypes=FLOAT_DTYPES)
    check_tensor("mag", mag, device=direction.device)
    check_shape("mag", mag, direction.shape[:-1], "direction's shape without the last dim")
    return (direction.float() * mag.float()[..., None]).to(direction.dtype)


# ----------------------------------------------------------------------------------------------------
# Compile variants (kvkernels.compile_check)
def angle(x_a: torch.Tensor, x_b: torch.Tensor) -> torch.Tensor:
    """``[N, H]`` float32 angle between ``x_a`` and ``x_b`` ``[N, H, D]``; 0 where either is the zero vector
    (``magnitude_direction_merge`` restores those exactly)."""
    a, b = x_a.float(), x_b.float()
    na, nb = a.norm(dim=-1), b.norm(dim=-1)
    cos = (a * b).sum(-1) / (na * nb).clamp_min(torch.finfo(torch.float32).tiny)
    return torch.where((na == 0) | (nb == 0), 0.0, torch.acos(cos.clamp(-1.0, 1.0)))


def merge_region(ka, kb, va, vb, pos, sa, sb, t: float, retain_ratio: float) -> dict[str, torch.Tensor]:
    """A merged pair's region (docs/contract.md §5.1) from two layers' kept tokens ``[N, Hkv, D]`` (positions
    and own scores ``[N, Hkv]``): one shared slot per merged token, ``a``-then-``b`` private slots for each
    retained one. Returns ``[n_slots, Hkv, ...]`` tensors ``k v pos score k_mag_a k_mag_b v_mag_a v_mag_b
    mask``; used by ``kvmodels.cache.PagedKVCache``."""
    N, H = pos.shape
    dk, mka, mkb, _ = magnitude_direction_merge(ka.contiguous(), kb.contiguous(), t=t, retain_ratio=0.0)
    dv, mva, mvb, _ = magnitude_direction_merge(va.contiguous(), vb.contiguous(), t=t, retain_ratio=0.0)
    ret = retained_mask(torch.maximum(angle(ka, kb), angle(va, vb)), retain_ratio)  # [N, H]
    n_slots = N + int(ret[:, 0].sum()) if N else 0
    first = torch.arange(N, device=pos.device)[:, None] + ret.cumsum(0) - ret.long()  # [N, H]
    second = torch.where(ret, first + 1, n_slots)  # b's private slot; n_slots is a dump row

    def place(x_first: torch.Tensor, x_second: torch.Tensor) -> torch.Tensor:
        """[N, H, ...] values of every first and (retained: second) slot -> [n_slots, H, ...]."""
        out = x_first.new_zeros(n_slots + 1, *x_first.shape[1:])
        shape = x_first.shape
        for index, x in ((first, x_first), (second, x_second)):
            out.scatter_(0, index.view(N, H, *[1] * (len(shape) - 2)).expand(shape), x.to(out.dtype))
        return out[:n_slots]

    r3, one = ret[..., None], torch.ones_like(mka)
    return {
        "k": place(torch.where(r3, ka, dk), kb),
        "v": place(torch.where(r3, va, dv), vb),
        "pos": place(pos, pos),
        "score": place(torch.where(ret, sa, sa + sb), sb),
        "k_mag_a": place(torch.where(ret, one, mka), one),
        "k_mag_b": place(torch.where(ret, one, mkb), one),
        "v_mag_a": place(torch.where(ret, one, mva), one),
        "v_mag_b": place(torch.where(ret, one, mvb), one),
        "mask": place(torch.where(ret, 1, 3).to(torch.uint8), torch.full_like(pos, 2, dtype=torch.uint8)),
    }


# ----------------------------------------------------------------------------------------------------

COMPILE_AXES: dict[str, tuple] = {"dtype": FLOAT_DTYPES, "head_dim": (64, 128, 96)}


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs: each thunk calls :func:`magnitude_direction_merge_triton` on ``meta``
    tensors with one configuration of :data:`COMPILE_AXES` (every pair is the whole product here)."""
    for cfg in covering(COMPILE_AXES, full=full):
        label = "magnitude_direction_merge " + " ".join(f"{k}={v}" for k, v in cfg.items())

        def thunk(dtype=cfg["dtype"], head_dim=cfg["head_dim"]) -> None:
            x = torch.empty(64, 2, head_dim, dtype=dtype, device="meta")
            magnitude_direction_merge_triton(x, torch.empty_like(x), t=0.5, retain_ratio=0.1)

        yield label, thunk
