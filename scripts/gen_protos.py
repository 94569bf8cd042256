"""Regenerate the Python gRPC code from proto/ into forkrl/wire/<service>/v1/.

    python scripts/gen_protos.py            # write the generated files
    python scripts/gen_protos.py --out DIR  # write them under DIR instead (the staleness test uses this)

The .proto files keep their packages (`forkrl.rollout.v1`, `forkrl.trainer.v1`): those names are on the
wire (`/forkrl.rollout.v1.RolloutService/Generate`) and in the descriptor pool. Only the *Python* modules
move under `forkrl.wire`, so that `forkrl/rollout` and `forkrl/trainer` do not read like the rollout and
the trainer: protoc writes `forkrl/<svc>/v1/*`, this script moves it to `forkrl/wire/<svc>/v1/*` and
rewrites the one import line per generated gRPC module that names the old location.

The output is deterministic for the pinned grpcio-tools version, so a test can compare it byte for byte
with the committed files.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"
WIRE = Path("forkrl/wire")
_IMPORT = re.compile(r"^from forkrl\.(\w+)\.v1 import", re.MULTILINE)


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # imported late so --help works without grpc-tools

    files = proto_files()
    written = []
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp)
        args = [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"--python_out={raw}",
            f"--pyi_out={raw}",
            f"--grpc_python_out={raw}",
            *[str(f.relative_to(PROTO_ROOT)) for f in files],
        ]
        if protoc.main(args) != 0:
            raise SystemExit("protoc failed")
        for f in files:
            rel_pkg = f.parent.relative_to(PROTO_ROOT)  # forkrl/rollout/v1
            dest_pkg = out / WIRE / Path(*rel_pkg.parts[1:])  # <out>/forkrl/wire/rollout/v1
            dest_pkg.mkdir(parents=True, exist_ok=True)
            for depth in range(len(WIRE.parts) + 1, len(dest_pkg.relative_to(out).parts) + 1):
                init = out / Path(*dest_pkg.relative_to(out).parts[:depth]) / "__init__.py"
                if not init.exists():  # forkrl/wire/__init__.py is hand-written (a docstring)
                    init.touch()
            for src in sorted((raw / rel_pkg).glob("*_pb2*.py*")):
                text = _IMPORT.sub(r"from forkrl.wire.\1.v1 import", src.read_text())
                dest = dest_pkg / src.name
                dest.write_text(text)
                written.append(dest)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT, help="output root (default: the repo root)")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
