"""Shared fixtures. Tests needing root or bcc skip on a developer's laptop but fail under CI=true."""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def require(condition: bool, reason: str) -> None:
    """Skip when a prerequisite is missing, except in CI where the missing prerequisite is a failure."""
    if condition:
        return
    if IN_CI:
        pytest.fail(f"prerequisite missing in CI: {reason}")
    pytest.skip(reason)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root") is not None:
        require(os.geteuid() == 0, "needs root (network namespaces, tc, XDP)")
    if item.get_closest_marker("bcc") is not None:
        try:
            import bcc  # noqa: F401
        except Exception as exc:  # ImportError or a broken libbcc
            require(False, f"needs bcc (python3-bpfcc): {exc}")
    if item.get_closest_marker("torch") is not None:
        try:
            import torch  # noqa: F401
        except ImportError as exc:
            require(False, f"needs PyTorch: {exc}")


@pytest.fixture(params=["userspace", pytest.param("xdp", marks=pytest.mark.bcc)])
def mode(request: pytest.FixtureRequest) -> str:
    """The LAN aggregation path a test runs on: the userspace fallback, and the XDP program (needs bcc)."""
    return str(request.param)
