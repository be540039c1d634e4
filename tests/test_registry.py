"""The policy registry: built-ins, the decorator, overwrite warnings, lazy entry-point plugins."""

from __future__ import annotations

import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvpolicies
from kvpolicies import EvictionPolicy, available, get_policy, register_policy

BUILTINS = {
    "eviction": {"full", "window", "streaming", "h2o", "keyformer", "a2sf", "snapkv", "scissorhands", "tova",
                 "chunkkv", "knorm", "kvzip"},
    "budget": {"uniform", "squeeze", "pyramid"},
    "merge": {"none", "minicache"},
}
PLUGINS = Path(__file__).parent / "plugins"


@pytest.mark.parametrize("role", sorted(BUILTINS))
def test_every_builtin_is_listed(role):
    rows = available(role)
    assert BUILTINS[role] <= {r.name for r in rows}
    for r in rows:
        assert r.role == role and r.description and "\n" not in r.description
        assert get_policy(r.name).role == role
        # Each built-in module's docstring cites its paper or says what it is.
        assert sys.modules[get_policy(r.name).__module__].__doc__


def test_available_filters_and_sorts():
    assert [r.name for r in available(pattern="s*")] == ["scissorhands", "snapkv", "streaming", "squeeze"]
    with pytest.raises(ValueError, match="role"):
        available("evictions")


def test_unknown_name_suggests():
    with pytest.raises(KeyError, match="did you mean 'keyformer'"):
        get_policy("keyfromer")
    with pytest.raises(kvpolicies.UnknownPolicyError, match="did you mean 'snapkv'"):
        get_policy("snapKV")


def test_decorator_registers_and_warns_on_overwrite(clean_registry):
    @register_policy("my_recent", role="eviction")
    @dataclass(frozen=True)
    class MyRecent(EvictionPolicy):
        """Mine: everything recent."""

    assert get_policy("my_recent") is MyRecent
    assert MyRecent.name == "my_recent" and MyRecent.description == "Mine: everything recent."
    assert ("my_recent", "eviction", "Mine: everything recent.") in available()
    assert kvpolicies.compose("my_recent", budget=4).name == "my_recent"

    with pytest.warns(UserWarning, match="already registered"):
        @register_policy("my_recent", role="eviction")
        @dataclass(frozen=True)
        class Other(EvictionPolicy):
            """Other."""
    assert get_policy("my_recent") is Other


def test_decorator_checks_role_and_name(clean_registry):
    with pytest.raises(TypeError, match="role"):
        @register_policy("wrong_role", role="budget")
        @dataclass(frozen=True)
        class Wrong(EvictionPolicy):
            """Wrong."""
    with pytest.raises(ValueError, match="'\\+'"):
        register_policy("a+b", role="eviction")
    with pytest.raises(ValueError, match="role"):
        register_policy("x", role="sharing")


def _install_plugin(tmp_path, monkeypatch, entry: str, source: Path = PLUGINS,
                    dist_name: str = "kvpolicies-plugin-demo") -> None:
    """Make a fake installed distribution ``dist_name`` whose entry point is ``entry`` (``name =
    module:attr``) and whose module lives in ``source``."""
    dist = tmp_path / f"{dist_name.replace('-', '_')}-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[kvpolicies.policies]\n{entry}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(str(source))


def test_entry_point_plugin_is_discovered_lazily(tmp_path, monkeypatch, clean_registry):
    _install_plugin(tmp_path, monkeypatch, "every_other = kvpolicies_plugin_demo:EveryOther")
    monkeypatch.delitem(sys.modules, "kvpolicies_plugin_demo", raising=False)
    assert "kvpolicies_plugin_demo" not in sys.modules
    cls = get_policy("every_other")               # the lookup imports the plugin, not before
    assert "kvpolicies_plugin_demo" in sys.modules
    assert cls.__name__ == "EveryOther" and cls.role == "eviction" and cls.name == "every_other"
    assert "every_other" in {r.name for r in available("eviction")}
    policy = kvpolicies.compose("squeeze+every_other", budget=0.5)
    assert policy.name == "squeeze+every_other"
    assert kvpolicies.compose(policy.spec()) == policy


def test_broken_plugin_only_warns(tmp_path, monkeypatch, clean_registry):
    _install_plugin(tmp_path, monkeypatch, "broken = kvpolicies_no_such_module:Nothing")
    with pytest.warns(UserWarning, match="could not load policy plugin 'broken'"):
        rows = available()
    assert "broken" not in {r.name for r in rows}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        available()   # a failed plugin is not retried
