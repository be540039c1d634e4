"""The policy registry: names -> policy classes, filled by a decorator and by entry points.

Built-in policies register when ``kvpolicies`` is imported. Third-party packages add policies through
the ``kvpolicies.policies`` entry-point group (``name = "module:attribute"``, the attribute a policy
class); those are imported lazily, the first time a name is not found or ``available()`` is called, so a
broken plugin costs nothing (and only warns) until it is asked for.

Names are unique across roles because ``compose`` takes bare names.
"""

from __future__ import annotations

import difflib
import fnmatch
import importlib.metadata
import warnings
from collections.abc import Callable
from typing import NamedTuple, TypeVar

from .base import ROLES, Policy, Role

ENTRY_POINT_GROUP = "kvpolicies.policies"

_REGISTRY: dict[str, type[Policy]] = {}
_entry_points_loaded: set[str] = set()   # entry-point names already imported (or failed)

P = TypeVar("P", bound=type[Policy])


class UnknownPolicyError(KeyError):
    """An unknown policy name; the message lists the closest registered names."""

    def __str__(self) -> str:   # KeyError would print the message in quotes
        return str(self.args[0])


class PolicyInfo(NamedTuple):
    """One row of ``available()``."""

    name: str
    role: Role
    description: str


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n")[0].strip()


def register_policy(name: str, *, role: Role, description: str | None = None) -> Callable[[P], P]:
    """Class decorator: register a policy class under ``name`` for ``role``.

    Parameters
    ----------
    name : str
        The name ``compose`` accepts (lower case, no ``+``).
    role : {"eviction", "budget", "merge", "heads"}
        Must match the class's base (``EvictionPolicy``, ``BudgetPolicy``, ``MergePolicy``,
        ``HeadBudgetPolicy``).
    description : str, optional
        One line for ``available()``; defaults to the first line of the class docstring.

    Re-registering a name replaces the old class and warns.
    """
    if role not in ROLES:
        raise ValueError(f"role={role!r} is not a policy role; choose one of {list(ROLES)}")
    if not isinstance(name, str) or not name or "+" in name or name != name.strip():
        raise ValueError(f"policy name {name!r} must be a non-empty string without '+' or spaces")

    def decorate(cls: P) -> P:
        if not (isinstance(cls, type) and issubclass(cls, Policy)):
            raise TypeError(f"@register_policy({name!r}) must decorate a Policy subclass, got {cls!r}")
        if getattr(cls, "role", None) != role:
            raise TypeError(f"@register_policy({name!r}, role={role!r}) decorates {cls.__name__}, whose role "
                            f"is {getattr(cls, 'role', None)!r}; derive it from the matching base class")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            warnings.warn(f"policy {name!r} is already registered ({_REGISTRY[name].__qualname__}); "
                          f"overwriting it with {cls.__qualname__}", UserWarning, stacklevel=2)
        cls.name = name
        cls.description = description or _first_line(cls.__doc__)
        _REGISTRY[name] = cls
        return cls

    return decorate


def _entry_points() -> list[importlib.metadata.EntryPoint]:
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _load_entry_point(ep: importlib.metadata.EntryPoint) -> None:
    _entry_points_loaded.add(ep.name)
    try:
        obj = ep.load()
    except Exception as exc:  # a broken plugin must not break the library
        warnings.warn(f"could not load policy plugin {ep.name!r} ({ep.value}): {exc!r}", UserWarning,
                      stacklevel=3)
        return
    if ep.name in _REGISTRY:
        return   # importing the module ran @register_policy
    if isinstance(obj, type) and issubclass(obj, Policy) and getattr(obj, "role", None) in ROLES:
        register_policy(ep.name, role=obj.role)(obj)
    else:
        warnings.warn(f"policy plugin {ep.name!r} ({ep.value}) is not a registered Policy subclass; "
                      f"decorate it with @register_policy", UserWarning, stacklevel=3)


def _discover(name: str | None = None) -> None:
    """Import entry points not seen yet: only ``name`` when given, else all."""
    for ep in _entry_points():
        if ep.name in _entry_points_loaded or (name is not None and ep.name != name):
            continue
        _load_entry_point(ep)


def get_policy(name: str) -> type[Policy]:
    """The policy class registered as ``name``.

    Raises
    ------
    UnknownPolicyError (a KeyError)
        Unknown name; the message lists the closest registered names.
    """
    if name not in _REGISTRY:
        _discover(name)
    if name not in _REGISTRY:
        _discover()
        close = difflib.get_close_matches(str(name), list(_REGISTRY), n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownPolicyError(f"unknown policy {name!r}{hint} (kvpolicies.available() lists all "
                       f"{len(_REGISTRY)} policies)")
    return _REGISTRY[name]


def available(role: Role | None = None, pattern: str | None = None) -> list[PolicyInfo]:
    """Registered policies as ``(name, role, description)`` rows, sorted by role then name.

    Parameters
    ----------
    role : {"eviction", "budget", "merge", "heads"}, optional
        Only this role.
    pattern : str, optional
        ``fnmatch`` pattern on the name, e.g. ``"s*"``.
    """
    if role is not None and role not in ROLES:
        raise ValueError(f"role={role!r} is not a policy role; choose one of {list(ROLES)}")
    _discover()
    rows = [PolicyInfo(n, c.role, c.description) for n, c in _REGISTRY.items()
            if (role is None or c.role == role) and (pattern is None or fnmatch.fnmatchcase(n, pattern))]
    return sorted(rows, key=lambda r: (ROLES.index(r.role), r.name))
