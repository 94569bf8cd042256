"""Fixtures for trainer tests: a real rollout service (vLLM) and a real trainer service process, shared by
every trainer test module (session scope: started once, whatever order the modules run in). Tests that
stop, kill or signal a service start their own (`start_trainer_service`, `start_rollout_service`); tests on
the shared ones measure versions and counters before and after, and never rely on what ran before."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.service_fixtures import ServiceAddress, start_rollout_service, start_trainer_service


@pytest.fixture(scope="session")
def rollout_address(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceAddress]:
    d = tmp_path_factory.mktemp("rollout")
    with start_rollout_service(tiny_model_dir, seed=0, staging_dir=d / "staging", log_path=d / "rollout.log",
                               expect_clean_stop=True) as address:
        yield address


@pytest.fixture(scope="session")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    # the session's temporary root: the run dirs of the tests (under their tmp_path) lie inside it
    runs_root = tmp_path_factory.getbasetemp()
    with start_trainer_service(runs_root, log_path=tmp_path_factory.mktemp("trainer") / "trainer.log",
                               expect_clean_stop=True) as address:
        yield address, runs_root
