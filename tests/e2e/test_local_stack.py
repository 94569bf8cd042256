"""All three services through the local launcher (compose.yaml's commands), a masked run, a probe.

start stack → clients/start_run.py --entropy-top-frac 0.2 (2 steps, a checkpoint each) → POST /probe of
both checkpoints → check the outputs → stop the stack and check that no process is left behind.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from forkrl.remote.channel import http_headers
from tests.service_fixtures import REPO_ROOT, free_port

pytestmark = [pytest.mark.slow, pytest.mark.isolated]  # its own stack, ports and data dir


def _descendants(pid: int) -> set[int]:
    """All live descendants of pid (from /proc, no psutil needed)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"


# How a service that lost its port to another process between free_port() and its bind says so.
_PORT_TAKEN = re.compile(r"in use|cannot listen|could not bind|Errno 98")


@contextlib.contextmanager
def _stack_on_free_ports(data: Path, attempts: int = 3) -> Iterator:
    """The compose services need their ports before they start (health checks name them), so they cannot
    bind port 0: pick free ports and start again with new ones if another process took one meanwhile."""
    from clients.stack import Stack, StackError

    for attempt in range(attempts):
        ports = {f"{n}_PORT": str(free_port()) for n in ("ROLLOUT", "TRAINER", "PROBE")}
        try:
            # FORKRL_TOKEN="" (not the suite's token): the stack must create its own and hand it out.
            stack = Stack(data_dir=data, echo=False, timeout=600, env={**ports, "FORKRL_TOKEN": ""}).start()
        except StackError as e:
            if attempt + 1 < attempts and _PORT_TAKEN.search(str(e)):
                continue
            raise
        break
    try:
        yield stack
    finally:
        stack.stop()


def test_stack_run_probe_and_clean_shutdown(tmp_path: Path, tiny_model_dir: Path) -> None:
    data = tmp_path / "data"
    # reuse the session's built model instead of building it again inside the stack's data dir
    (data / "models").mkdir(parents=True)
    os.symlink(tiny_model_dir, data / "models" / "tiny")
    pids: set[int] = set()
    with _stack_on_free_ports(data) as stack:
        addr = stack.addresses
        assert set(addr) >= {"rollout", "trainer", "probe"}
        for svc in stack.procs.values():
            if svc.running:
                pids.add(svc.proc.pid)
                pids |= _descendants(svc.proc.pid)

        run_dir = data / "runs" / "e2e"
        cmd = [sys.executable, str(REPO_ROOT / "clients" / "start_run.py"), "--entropy-top-frac", "0.2",
               "--num-steps", "2", "--save-every", "1", "--prompts-per-step", "8", "--group-size", "4",
               "--eval-prompts", "0", "--run-dir", str(run_dir), "--model", str(data / "models" / "tiny"),
               "--rollout-addresses", addr["rollout"], "--trainer-address", addr["trainer"]]
        # the token compose.yaml's one-shot `token` service created: private, and what every service requires
        assert stack.token_file.stat().st_mode & 0o777 == 0o600 and stack.token == stack.token_file.read_text().strip()
        assert httpx.get(f"{addr['probe']}/probe", timeout=30).status_code == 401
        assert httpx.get(f"{addr['probe']}/healthz", timeout=30).status_code == 200
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
                              env=stack.client_env())
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in lines if m["kind"] == "train"]
        assert [m["step"] for m in train] == [1, 2]
        # one micro-batch: exactly max(1, ceil(N / 5)) of the N response tokens are kept
        assert all(m["kept_tokens"] == max(1, -(-int(m["response_tokens"]) // 5)) for m in train)

        body = {"checkpoint_root": str(run_dir / "checkpoints"), "steps": [1], "include_final": True,
                "num_prompts": 4, "group_size": 4, "max_positions_per_group": 4, "seed": 0}
        auth = http_headers(stack.token)
        resp = httpx.post(f"{addr['probe']}/probe", params={"wait": "true"}, json=body, timeout=600, headers=auth)
        assert resp.status_code == 200, resp.text[:2000]
        summary = resp.json()
        labels = [c["label"] for c in summary["checkpoints"]]
        assert len(labels) == 2 and any("final" in lb for lb in labels), labels
        assert summary["n_records"] > 0
        results = summary["results"]
        assert results and {r["checkpoint"] for r in results} == set(labels)
        for r in results:
            med = r["grad_norm"]["median"]
            assert med is None or (math.isfinite(med) and med > 0)
        missing = httpx.post(f"{addr['probe']}/probe", json={**body, "steps": [7]}, timeout=60, headers=auth)
        assert missing.status_code == 404 and "available_steps" in missing.text
    leftover = [p for p in pids if _alive(p)]
    assert pids and not leftover, f"processes left running after the stack stopped: {leftover}"
