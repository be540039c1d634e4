"""Counter-based Gumbel noise: the same bits in torch and in Triton, for any chunking.

Keyformer perturbs logits with i.i.d. ``Gumbel(0, 1)`` noise. Drawing it from a generator would tie the
draws to the order and shape of the work, so prefill scores would change with the chunk size and the
Triton kernel could not reproduce the reference. Instead every noise value is a pure function of
``(seed, query head, query index, key index)``:

1. ``key = absorb(absorb(SEED_INIT, seed & 0xFFFFFFFF), (seed >> 32) & 0xFFFFFFFF)`` (host side, once);
2. ``h = absorb(absorb(absorb(key, head), q_idx), k_idx)``, where
   ``absorb(h, v) = fmix32(((h ^ v) + 0x9E3779B9) mod 2**32)`` and ``fmix32`` is MurmurHash3's 32-bit
   finaliser (xor-shift 16, multiply ``0x85EBCA6B``, xor-shift 13, multiply ``0xC2B2AE35``, xor-shift 16);
   adding the golden-ratio constant keeps ``absorb`` free of the ``fmix32(0) == 0`` fixed point;
3. ``u = ((h >> 9) + 0.5) / 2**23`` — 23 hash bits, so ``u`` is exact in float32 and lies in
   ``[2**-24, 1 - 2**-24]``, never 0 or 1;
4. ``G = -log(-log(u))``.

Torch has no unsigned 32-bit arithmetic, so the torch form works on the same 32 bits as signed int32:
``+``, ``*`` and ``^`` give the same bits in two's complement (torch's int32 kernels wrap on overflow, as
the hardware's vector multiply does; ``tests/test_score_update.py`` checks every value against a
Python big-int oracle), and a logical right shift is an arithmetic one masked to the low ``32 - s`` bits.
(An earlier int64 form split each multiply into 16-bit halves: ~10x slower on CPUs without a 64-bit vector
multiply, and most of Keyformer's CPU prefill.) Host-side Python ints (the seed key) use exact unsigned
arithmetic. Triton uses native ``uint32`` arithmetic. The hash bits agree exactly; ``G`` agrees to the last
ulp or two of ``log``: the kernels take their own ``log`` (:func:`log_positive_tl`), a polynomial for the
only arguments the noise has (positive, normal, finite: ``u`` and ``-log(u)``) within 1.35 ulp of the exact
logarithm on every one of them (``tests/test_score_update.py`` checks all 2**23 values of ``u``), where
libdevice's ``logf`` also handles zero, negatives, subnormals and infinities on every call.

Decode steps draw fresh noise per step from the same hash, keyed (:func:`gumbel_noise_keyed`): the cache
hands the decode kernel one 32-bit key per (sequence, query head) and step (:func:`decode_keys`), and the
noise on slot ``j`` is ``G`` of ``absorb(key, j)``. The kernel computes it where it uses it, so no
``[layers, B, Hq, slots]`` buffer is drawn, stored or read.
"""

from __future__ import annotations

import torch

from kvkernels._triton import HAS_TRITON, launch, require_triton, tl, triton

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_FMIX_A = 0x85EBCA6B
_FMIX_B = 0xC2B2AE35
_SEED_INIT = 0x243F6A88  # first hex digits of pi: any fixed nonzero start
_U_SCALE = 2.0**-23

IntLike = torch.Tensor | int


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finaliser on a Python int in ``[0, 2**32)`` (exact arithmetic, host side)."""
    h ^= h >> 16
    h = (h * _FMIX_A) & _MASK32
    h ^= h >> 13
    h = (h * _FMIX_B) & _MASK32
    return h ^ (h >> 16)


def _absorb(h: int, v: int) -> int:
    return _fmix32(((h ^ v) + _GOLDEN) & _MASK32)


def seed_key(seed: int) -> int:
    """The 32-bit hash key of a seed (any int; it is taken modulo ``2**64``)."""
    s = int(seed) & 0xFFFFFFFFFFFFFFFF
    return int(_absorb(_absorb(_SEED_INIT, s & _MASK32), s >> 32))


def _shr_i32(h: torch.Tensor, s: int, *, out: torch.Tensor) -> torch.Tensor:
    """Logical right shift of int32 bits into ``out``: the arithmetic shift, sign copies masked off."""
    return torch.bitwise_right_shift(h, s, out=out).bitwise_and_((1 << (32 - s)) - 1)


def _absorb_i32(h: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """:func:`_absorb` on int32 tensors holding the 32-bit values' bits (wrapping ``+`` and ``*``), ``h``
    and ``v`` broadcast. After the one allocation of ``h ^ v`` it works in place with one scratch buffer:
    on CPU a fresh block per operation costs as much as the arithmetic (new pages each time)."""
    h = torch.bitwise_xor(h, v).add_(_as_int32(_GOLDEN))
    scratch = torch.empty_like(h)
    for shift, factor in ((16, _FMIX_A), (13, _FMIX_B), (16, None)):
        h.bitwise_xor_(_shr_i32(h, shift, out=scratch))
        if factor is not None:
            h.mul_(_as_int32(factor))
    return h


def _hash_i32(seed: int, head: IntLike, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash of :func:`hash_u32` as int32 bits (``bits & 0xFFFFFFFF`` is the unsigned value)."""
    dev = q_idx.device
    h = torch.tensor(_as_int32(seed_key(seed)), dtype=torch.int32, device=dev)
    h = _absorb_i32(h, torch.as_tensor(head, device=dev).to(torch.int32))
    h = _absorb_i32(h, q_idx.to(torch.int32))
    return _absorb_i32(h, k_idx.to(torch.int32))


def hash_u32(seed: int, head: IntLike, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
    """The 32-bit hash behind :func:`gumbel_noise_hash`, as int64 values in ``[0, 2**32)``.

    ``head``, ``q_idx`` and ``k_idx`` are integers in ``[0, 2**31)`` (tensors broadcast together).
    """
    return _hash_i32(seed, head, q_idx, k_idx).to(torch.int64) & _MASK32


def _gumbel_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """``G = -log(-log(u))`` of 32-bit hash values held as int32 (consumed: mapped in place)."""
    u = bits.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF).to(torch.float32)  # the top 23 bits
    return u.add_(0.5).mul_(_U_SCALE).log_().neg_().log_().neg_()  # exact u, then -log(-log(u))


def gumbel_noise_keyed(keys: torch.Tensor, n_slots: int) -> torch.Tensor:
    """The decode kernels' Gumbel noise: ``[..., n_slots]`` float32 for ``keys [...]`` int32 (one key per
    sequence and query head: ``[B, Hq]``).

    ``noise[..., j] = -log(-log(u))`` with ``u`` from ``absorb(keys[...], j)`` (module docstring; ``keys``
    hold the 32-bit keys' bits as int32), what the Triton helper :func:`gumbel_keyed_tl` computes in the
    kernel. A cache passes fresh keys every decode step (:func:`decode_keys`), so every step draws fresh,
    reproducible noise without a buffer.
    """
    slots = torch.arange(n_slots, dtype=torch.int32, device=keys.device)
    return _gumbel_of_bits(_absorb_i32(keys.to(torch.int32)[..., None], slots))


def decode_keys(noise_seed: int, step: int, n_layers: int, batch: int, n_heads: int) -> torch.Tensor:
    """``[n_layers, batch, n_heads]`` int32 keys of decode step ``step``'s Gumbel noise
    (:func:`gumbel_noise_keyed`), on the CPU: ``absorb`` of ``seed_key(noise_seed)`` with the step, the
    layer, the row and the query head in turn; distinct per (step, layer, row, head) and reproducible from
    the cache's :func:`noise_seed` (the prompt's noise uses :func:`prefill_seed` keys)."""
    if step < 0:
        raise ValueError(f"step={step} must be >= 0")
    h = torch.tensor(_as_int32(_absorb(seed_key(noise_seed), step & _MASK32)), dtype=torch.int32)
    layers, rows, heads = (torch.arange(n, dtype=torch.int32) for n in (n_layers, batch, n_heads))
    h = _absorb_i32(h, layers)[:, None, None]
    return _absorb_i32(_absorb_i32(h, rows[None, :, None]), heads[None, None, :])


def gumbel_noise_hash(seed: int, head: IntLike, q_idx: torch.Tensor, k_idx: torch.Tensor) -> torch.Tensor:
    """Reproducible ``Gumbel(0, 1)`` noise for the logit of query ``q_idx`` and key ``k_idx``.

    Parameters
    ----------
    seed : int
        Noise seed (taken modulo ``2**64``).
    head : Tensor or int
        Query-head index (``>= 0``); integer tensor broadcastable with ``q_idx`` and ``k_idx``.
    q_idx, k_idx : Tensor
        Query and key positions (``>= 0``), integer tensors that broadcast together.

    Returns
    -------
    Tensor
        float32, the broadcast shape of ``head``, ``q_idx`` and ``k_idx``, on ``q_idx.device``. Each value
        depends only on ``(seed, head, q_idx, k_idx)``: see the module docstring for the exact hash, which
        the Triton helper :func:`gumbel_noise_tl` reproduces bit for bit.
    """
    return _gumbel_of_bits(_hash_i32(seed, head, q_idx, k_idx))  # a fresh tensor: mapped in place


def _as_int32(key: int) -> int:
    """A 32-bit key as the signed int32 with the same bits (what a Triton ``i32`` argument carries)."""
    return key - (1 << 32) if key >= (1 << 31) else key


if HAS_TRITON:

    @triton.jit
    def _fmix32_tl(h):
        h = h ^ (h >> 16)
        h = h * 0x85EBCA6B
        h = h ^ (h >> 13)
        h = h * 0xC2B2AE35
        return h ^ (h >> 16)

    @triton.jit
    def _absorb_tl(h, v):
        return _fmix32_tl((h ^ v.to(tl.uint32, bitcast=True)) + 0x9E3779B9)

    @triton.jit
    def hash_u32_tl(key, head, q_idx, k_idx):
        """Triton form of :func:`hash_u32`: ``key`` is ``seed_key(seed)`` passed as an int32 (its bits),
        ``head``/``q_idx``/``k_idx`` int32 scalars or tensors (they broadcast). Returns uint32."""
        # tl.cast, not tl.to_tensor (absent from Triton 3.6): an int argument equal to 1 arrives as a
        # constexpr, and tl.cast turns a constexpr or a scalar tensor into a tensor in every version.
        h = tl.cast(tl.cast(key, tl.int32), tl.uint32, bitcast=True)
        h = _absorb_tl(h, tl.cast(head, tl.int32))
        h = _absorb_tl(h, q_idx.to(tl.int32))
        return _absorb_tl(h, k_idx.to(tl.int32))

    @triton.jit
    def log_positive_tl(x):
        """``log(x)`` of float32 ``x`` that is positive, normal and finite (else undefined): ``x = 2**e * f``
        with ``f`` in ``[2/3, 4/3)`` from the bits (``0x3F2AAAAB``: 2/3's, rounded up; ``e`` shifted out
        of the exponent field), then ``e log(2) + log1p(t)``, ``t = f - 1``, with ``log1p(t) = t - t**2 / 2
        + t**3 P(t)``: 10 multiply-adds and five integer operations. ``P``'s degree-6 coefficients were
        fitted for this library (Lawson's iteration toward the least maximum relative error of ``log1p`` on
        ``t``'s range: 3.7e-8). Within 1.35 ulp of the exact ``log`` on the noise's arguments (``u`` in
        ``[2**-24, 1 - 2**-24]`` and ``-log(u)``), where ``tl.log`` (libdevice) adds a subnormal rescale and
        zero, negative and infinity checks on every call."""
        bits = x.to(tl.int32, bitcast=True)
        e = (bits - 0x3F2AAAAB) >> 23  # arithmetic shift: e < 0 for x < 2/3
        t = (bits - (e << 23)).to(tl.float32, bitcast=True) - 1.0
        p = 0.13819828629493713 * t - 0.15122221410274506  # P's coefficients, highest first
        p = p * t + 0.14042386412620544
        p = p * t - 0.16472318768501282
        p = p * t + 0.20007915794849396
        p = p * t - 0.2500423789024353
        p = p * t + 0.3333326578140259
        return e.to(tl.float32) * 0.6931471805599453 + ((p * t - 0.5) * (t * t) + t)

    @triton.jit
    def _uniform_of_bits_tl(bits):
        """``u`` of 32 hash bits (uint32): the top 23, exact in float32, in ``(0, 1)``."""
        return ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # 2**-23

    @triton.jit
    def _uniform_tl(key, head, q_idx, k_idx):
        """The ``u`` of :func:`gumbel_noise_hash`: 23 hash bits, exact in float32, in ``(0, 1)``."""
        return _uniform_of_bits_tl(hash_u32_tl(key, head, q_idx, k_idx))

    @triton.jit
    def gumbel_keyed_tl(key, slot):
        """Triton form of :func:`gumbel_noise_keyed`: ``key`` int32 as loaded from a key tensor, ``slot``
        int32 (they broadcast, e.g. ``key[:, None]`` and ``slot[None, :]``); float32."""
        u = _uniform_of_bits_tl(_absorb_tl(key.to(tl.uint32, bitcast=True), slot))
        return -log_positive_tl(-log_positive_tl(u))

    @triton.jit
    def gumbel_noise_tl(key, head, q_idx, k_idx):
        """Triton form of :func:`gumbel_noise_hash` (``key`` as in :func:`hash_u32_tl`); float32."""
        return -log_positive_tl(-log_positive_tl(_uniform_tl(key, head, q_idx, k_idx)))

    @triton.jit
    def gumbel_weight_tl(key, head, q_idx, k_idx):
        """``exp(G)`` of the same noise from one ``log``: ``G = -log(E)`` with ``E = -log(u)``, so
        ``exp(G) = 1 / E``. At temperature 1, ``exp(x + G - m) = exp(x - m) * exp(G)``: a logit's
        perturbed softmax term takes one ``log`` and one reciprocal instead of two ``log``s (the prefill
        scorer's cost, most of Keyformer's prefill on a GPU). Agrees with ``exp(gumbel_noise_tl)`` to a
        few ulp."""
        return -1.0 / log_positive_tl(_uniform_tl(key, head, q_idx, k_idx))

    @triton.jit
    def _noise_kernel(bits_ptr, noise_ptr, q_ptr, k_ptr, n, key, head, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        q_idx = tl.load(q_ptr + offs, mask=ok, other=0)
        k_idx = tl.load(k_ptr + offs, mask=ok, other=0)
        tl.store(bits_ptr + offs, hash_u32_tl(key, head, q_idx, k_idx).to(tl.int64), mask=ok)
        tl.store(noise_ptr + offs, gumbel_noise_tl(key, head, q_idx, k_idx), mask=ok)


def gumbel_noise_hash_triton(seed: int, head: int, q_idx: torch.Tensor,
                             k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Evaluate the Triton helpers elementwise (for tests and for filling noise buffers on the GPU).

    ``q_idx``, ``k_idx``: integer tensors of one shape, values in ``[0, 2**31)``. Returns
    ``(bits int64, noise float32)`` of that shape, matching :func:`hash_u32` / :func:`gumbel_noise_hash`.
    """
    require_triton()
    if q_idx.shape != k_idx.shape:
        raise ValueError(f"q_idx {list(q_idx.shape)} and k_idx {list(k_idx.shape)} must have one shape; "
                         "broadcast them first")
    q_flat = q_idx.reshape(-1).to(torch.int32).contiguous()
    k_flat = k_idx.reshape(-1).to(torch.int32).contiguous()
    bits = torch.empty(q_flat.shape, dtype=torch.int64, device=q_idx.device)
    noise = torch.empty(q_flat.shape, dtype=torch.float32, device=q_idx.device)
    n, block = q_flat.numel(), 1024
    if n:
        launch(_noise_kernel, (triton.cdiv(n, block),), bits, noise, q_flat, k_flat, n,
               _as_int32(seed_key(seed)), int(head), BLOCK=block)
    return bits.view(q_idx.shape), noise.view(q_idx.shape)


def compile_variants(full: bool = False):
    """``(label, thunk)`` pairs for :func:`gumbel_noise_hash_triton` on ``meta`` tensors: head 0, 1 (an
    int argument equal to 1 is specialised as a constant) and 5."""
    for head in (0, 1, 5):
        def thunk(head=head) -> None:
            idx = torch.empty(100, dtype=torch.int32, device="meta")
            gumbel_noise_hash_triton(7, head, idx, idx)

        yield f"gumbel_noise_hash head={head}", thunk


# --- seeds shared by both caches -----------------------------------------------------------------

def noise_seed(policy_seed: int, seed: int) -> int:
    """Seed of a cache's Gumbel noise from the policy's seed and the cache's (e.g. a generation's) seed.

    The paged cache (``kvmodels.cache.PagedKVCache``) derives its decode steps' keys (:func:`decode_keys`)
    and the prompt-scoring seeds (:func:`prefill_seed`) from it, so a run with the same seeds draws
    identical noise.
    """
    return (int(policy_seed) * 1_000_003 + int(seed)) % 2**62


def prefill_seed(noise_seed: int, l: int, b: int) -> int:
    """Seed of the prompt-scoring noise of cache layer ``l``, sequence ``b`` (``prefill_scores(seed=...)``):
    distinct per (layer, sequence), reproducible from the cache's :func:`noise_seed`."""
    return ((int(noise_seed) * 1_000_033 + l) * 1_000_037 + b) % 2**62
