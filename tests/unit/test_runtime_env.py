"""The process defaults of forkrl/runtime.py that depend on where the checkout sits."""

from __future__ import annotations

import os
import socket
import stat
import uuid
from pathlib import Path

import pytest

from forkrl import runtime


@pytest.mark.parametrize("depth", [1, 160])
def test_vllm_can_bind_its_sockets_wherever_the_checkout_sits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              depth: int) -> None:
    """issue 42 item 14: from a checkout under a long folder every vLLM engine failed to start: its sockets
    (<VLLM_RPC_BASE_PATH>/<uuid4>, in the checkout's .cache) were longer than a unix socket's 107 bytes."""
    cache = tmp_path / ("a" * depth) / ".cache"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    env["FORKRL_CACHE_DIR"] = str(cache)
    monkeypatch.setattr(os, "environ", env)  # apply_runtime_env sets its defaults in this copy only
    runtime.apply_runtime_env()
    base = Path(env["VLLM_RPC_BASE_PATH"])
    with socket.socket(socket.AF_UNIX) as s:  # what vLLM's engine does (zmq ipc://)
        s.bind(str(base / str(uuid.uuid4())))
    if len(os.fsencode(cache / "vllm-rpc")) + 37 <= 107:
        assert base == cache / "vllm-rpc"  # the checkout's own cache when it fits
    else:
        st = base.lstat()
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700


def test_a_socket_folder_someone_else_prepared_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path))
    planted = tmp_path / f"forkrl-rpc-{os.getuid()}"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)  # another user could swap the engine's sockets
    with pytest.raises(RuntimeError, match=r"forkrl-rpc-.* must be a folder owned by uid .* mode 0700, got mode 0777"):
        runtime.rpc_dir(tmp_path / ("a" * 160) / ".cache")
