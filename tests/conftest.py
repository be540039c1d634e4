"""Test configuration: Triton interpreter on CPU, Hypothesis profiles, device fixtures.

``TRITON_INTERPRET=1`` must be set before triton is imported, so it happens here, first. On a CUDA
machine run with ``KVPOLICIES_TEST_DEVICE=cuda`` (the nox ``gpu`` session does) to compile the kernels.
"""

from __future__ import annotations

import os

if os.environ.get("KVPOLICIES_TEST_DEVICE", "cpu") != "cuda":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

from devices import DEVICE  # noqa: E402

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
# CI: deterministic and modest (CI sets CI=true).
settings.register_profile("ci", max_examples=15, derandomize=True, print_blob=True, **_common)
# Local default: a little more exploration.
settings.register_profile("dev", max_examples=30, **_common)
# Nightly / before a release: heavy.
settings.register_profile("nightly", max_examples=400, **_common)
# On a GPU the kernels are compiled, so examples are cheap.
settings.register_profile("gpu", max_examples=200, derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add synchronisation (up to 100x slower on a loaded 2-core box).

    Modules opt in with ``pytestmark = pytest.mark.usefixtures("one_thread")``.
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def clean_registry():
    """Restore the policy registry after a test that registers policies (or loads plugins)."""
    from kvpolicies import registry as reg

    saved, loaded = dict(reg._REGISTRY), set(reg._entry_points_loaded)
    yield
    reg._REGISTRY.clear()
    reg._REGISTRY.update(saved)
    reg._entry_points_loaded.clear()
    reg._entry_points_loaded.update(loaded)


@pytest.fixture
def device() -> torch.device:
    dev = DEVICE
    if dev.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("KVPOLICIES_TEST_DEVICE=cuda but no CUDA device")
    return dev


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
