"""Parameter checks shared by the precision policies: a format the packed rows can hold."""

from __future__ import annotations

from kvkernels.quant import BITS as QUANT_BITS

from ..base import NATIVE_BITS, check_int


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
