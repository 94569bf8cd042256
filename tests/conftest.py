"""Shared fixtures. `tiny_model_dir` builds the default tiny model once (cached on disk across runs).

Markers (registered in pyproject.toml): slow, docker, isolated.
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from forkrl.models.tiny import build_tiny_model, default_model_dir

    return build_tiny_model(default_model_dir(), progress=False)
