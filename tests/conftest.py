"""Shared pytest setup: hypothesis profile for CI."""

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", deadline=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile("ci")


@pytest.fixture
def kernels_built_with(monkeypatch):
    """``build(*options)``: from then on kbit_cupy compiles its kernels with the
    package's options plus ``options`` (an A/B knob's ``-DNAME=VALUE``; none: the
    default build, whose kernels may be cached on disk), into an empty in-process
    kernel cache. Undone after the test."""
    from kbit_cupy import _jit

    base = _jit.compile_options

    def build(*options):
        monkeypatch.setattr(_jit, "compile_options", lambda: (*base(), *options))
        monkeypatch.setattr(_jit, "_kernels", {})  # this build's kernels only

    return build


@pytest.fixture
def kernel_requests(monkeypatch):
    """A list that records each ``(family, template args)`` kbit_cupy asks its
    kernel cache for (``_jit.get_kernel``) from then on; clear it between calls."""
    from kbit_cupy import _jit

    asked = []
    get_kernel = _jit.get_kernel

    def recording(family, *args):
        asked.append((family, args))
        return get_kernel(family, *args)

    monkeypatch.setattr(_jit, "get_kernel", recording)
    return asked
