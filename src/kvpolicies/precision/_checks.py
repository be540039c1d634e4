"""Parameter checks shared by the precision policies: a format the packed rows can hold."""

from __future__ import annotations

from kvkernels.quant import BITS as QUANT_BITS

from ..base import NATIVE_BITS, check_bool, check_int


def check_bits(policy: str, name: str, value: object, *, native: bool = False) -> None:
    """``value`` in 2, 4, 8 (or :data:`NATIVE_BITS` when ``native``), else ``ValueError`` naming it."""
    allowed = QUANT_BITS + ((NATIVE_BITS,) if native else ())
    if isinstance(value, bool) or value not in allowed:
        what = ", ".join(map(str, allowed))
        extra = f" ({NATIVE_BITS} = unquantized, the cache's dtype)" if native else ""
        raise ValueError(f"{policy}: {name}={value!r} must be one of {what}{extra}")


def check_group(policy: str, group: object) -> None:
    check_int(policy, "group", group, 1)
    if group & (group - 1):  # type: ignore[operator]
        raise ValueError(f"{policy}: group={group!r} must be a power of two (channels per scale and zero "
                         "point; it must divide the model's head dim)")


def check_rotate(policy: str, rotate: object, channel_scale: bool, native: str | None) -> None:
    """``rotate`` a bool; with it, no ``channel_scale`` (the rotation already spreads the outlier channels)
    and no token kept in the cache's dtype (``native`` names the argument that keeps some: the attention
    reads every region in one basis, and an unquantized row must stay bit-identical, which a rotation
    round trip is not)."""
    check_bool(policy, "rotate", rotate)
    if not rotate:
        return
    if channel_scale:
        raise ValueError(f"{policy}: rotate=True and channel_scale=True: choose one (the rotation already "
                         "spreads a large channel over all channels)")
    if native is not None:
        raise ValueError(f"{policy}: rotate=True stores rotated rows, but {native} keeps some tokens "
                         "unquantized, which must stay bit-identical to what was written; quantize every "
                         "token or use rotate=False")
