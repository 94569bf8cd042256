"""Shared fixtures. `tiny_model_dir` builds the default tiny model once (cached on disk across runs)."""

from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: needs more than a second or two (still runs in CI)")


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from forkrl.models.tiny import build_tiny_model, default_model_dir

    return build_tiny_model(default_model_dir(), progress=False)
