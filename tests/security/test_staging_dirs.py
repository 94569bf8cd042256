"""The shared-memory staging folders are this user's alone (issue 42 item 5): /dev/shm/forkrl-sync was created with
mkdir(exist_ok=True) and no check, and is a LoadWeights root, so another local user who created it first could
swap the weights file between the trainer's write and the rollout's reload."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from forkrl.weights.shm import SYNC_DIR_ENV, SharedWeightsFile, UnsafeDirectory, default_sync_dir, private_dir
from rollout_service.config import RolloutSettings
from rollout_service.receive import default_staging_dir

STATE = {"w": torch.arange(6, dtype=torch.float32)}
OTHER_UID = 54321  # a uid no process of the test runs as


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def _refused(folder: Path, why: str) -> None:
    f = SharedWeightsFile(folder)
    with pytest.raises(UnsafeDirectory, match=why) as err:
        f.write(STATE)
    assert str(folder) in str(err.value)
    assert not f.path.exists()  # nothing was written into it


def test_default_folders_are_per_user(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(SYNC_DIR_ENV, raising=False)
    sync = default_sync_dir()
    if sync is not None:  # a writable /dev/shm
        assert sync == Path("/dev/shm") / f"forkrl-sync-{os.geteuid()}"
    assert default_staging_dir().name.endswith(f"-{os.geteuid()}") or default_staging_dir().name == "weights-staging"


def test_a_new_folder_is_created_0700_whatever_the_umask(tmp_path: Path):
    old = os.umask(0)
    try:
        f = SharedWeightsFile(tmp_path / "sync")
        path = f.write(STATE)
    finally:
        os.umask(old)
    assert _mode(tmp_path / "sync") == 0o700 and _mode(path) == 0o600
    f.discard()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_a_folder_another_user_created_first_is_refused(tmp_path: Path):
    folder = tmp_path / "sync"
    folder.mkdir(mode=0o700)
    os.chown(folder, OTHER_UID, OTHER_UID)
    _refused(folder, f"owned by uid {OTHER_UID}")


def test_a_world_writable_or_linked_folder_is_refused(tmp_path: Path):
    open_folder = tmp_path / "open"
    open_folder.mkdir()
    open_folder.chmod(0o777)
    _refused(open_folder, "mode 0777")
    assert _mode(open_folder) == 0o777  # left as it is: the operator decides
    target = tmp_path / "mine"
    private_dir(target)
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    _refused(link, "symlink")


def test_an_own_folder_others_could_only_read_is_narrowed(tmp_path: Path):
    folder = tmp_path / "sync"
    folder.mkdir()
    folder.chmod(0o755)  # as an older forkrl left it
    assert private_dir(folder) == folder and _mode(folder) == 0o700


def test_the_rollout_loads_from_the_sync_dir_only_while_it_is_private(monkeypatch, tmp_path: Path):
    folder = tmp_path / "sync"
    monkeypatch.setenv(SYNC_DIR_ENV, str(folder))
    settings = RolloutSettings(model=str(tmp_path / "model"), allowed_roots=[str(tmp_path / "runs")])
    assert folder.resolve() not in settings.load_roots()  # missing: nothing to load from it
    private_dir(folder)
    assert folder.resolve() in settings.load_roots()
    folder.chmod(0o777)  # anyone could have put weights there
    assert folder.resolve() not in settings.load_roots()
