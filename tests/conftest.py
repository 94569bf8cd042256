"""Shared fixtures. `tiny_model_dir` is the embedded default: the committed forkrl/models/default (the same
bytes on every machine), or $FORKRL_MODEL_DIR, built there once when it holds no build yet (cached on disk).

The suite's bearer token is set here, for every service and client the tests start (forkrl/security.py).
Markers (registered in pyproject.toml): slow, docker, isolated.
"""

import atexit
import os
import secrets
import shutil
import tempfile
from pathlib import Path

import pytest

# Every service the tests start requires this token (they inherit the environment), and every client the tests
# use sends it (forkrl.security reads FORKRL_TOKEN): the suite runs secure by default. Tests of the token
# itself pass their own.
os.environ["FORKRL_TOKEN"] = "forkrl-test-" + secrets.token_hex(8)
os.environ.pop("FORKRL_TOKEN_FILE", None)
# TLS is off unless a test turns it on (tests/security/test_tls.py): an operator's settings must not leak in.
for _var in ("FORKRL_TLS_CA", "FORKRL_TLS_CERT", "FORKRL_TLS_KEY", "FORKRL_TLS_SERVER_NAME"):
    os.environ.pop(_var, None)
# The normalized tables of the datasets the tests read (forkrl/data/datasets.py) go to a cache of this session,
# shared with the services it starts, and removed at the end: nothing piles up in ~/.cache.
os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="forkrl-test-datasets-")
atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], True)


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    from forkrl.models.tiny import build_tiny_model, default_model_dir

    return build_tiny_model(default_model_dir(), progress=False)
