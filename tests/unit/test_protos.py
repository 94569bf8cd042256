"""The committed generated gRPC code must equal what scripts/gen_protos.py produces from proto/."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_protos.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True, timeout=120)
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert len(generated) == 10  # 2 protos x (pb2, pyi, grpc) + 4 __init__.py
    stale = [str(rel) for rel in generated if not (ROOT / rel).is_file()
             or (ROOT / rel).read_bytes() != (tmp_path / rel).read_bytes()]
    assert not stale, f"generated code is stale, run `python scripts/gen_protos.py`: {stale}"


def test_contract_has_the_rpcs() -> None:
    from forkrl.wire.rollout.v1 import rollout_pb2
    from forkrl.wire.trainer.v1 import trainer_pb2

    rollout = rollout_pb2.DESCRIPTOR.services_by_name["RolloutService"]
    assert {m.name for m in rollout.methods} == {"Generate", "UpdateWeights", "LoadWeights", "GetInfo",
                                                    "ReleaseLease", "InitWeightTransfer", "StartWeightUpdate",
                                                    "UpdateWeightChunk", "FinishWeightUpdate", "AbortWeightUpdate",
                                                    "ShutdownWeightTransfer"}
    assert rollout.methods_by_name["Generate"].server_streaming
    assert rollout.methods_by_name["UpdateWeights"].client_streaming
    trainer = trainer_pb2.DESCRIPTOR.services_by_name["TrainerService"]
    assert {m.name for m in trainer.methods} == {"StartRun", "WatchRun", "GetRun", "StopRun"}
    assert trainer.methods_by_name["WatchRun"].server_streaming
    assert "entropy_top_frac" in trainer_pb2.RunConfig.DESCRIPTOR.fields_by_name
