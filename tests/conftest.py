"""Shared fixtures. `tiny_model_dir` is the embedded default: the committed forkrl/models/default (the same
bytes on every machine), or $FORKRL_MODEL_DIR, built there once when it holds no build yet (cached on disk).

Markers (registered in pyproject.toml): slow, docker, isolated.
"""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from forkrl.models.tiny import build_tiny_model, default_model_dir

    return build_tiny_model(default_model_dir(), progress=False)
