"""Regenerate the Python gRPC code from proto/ into forkrl/<service>/v1/.

    python scripts/gen_protos.py            # write the generated files
    python scripts/gen_protos.py --out DIR  # write them under DIR instead (the staleness test uses this)

The output is deterministic for the pinned grpcio-tools version, so a test can compare it byte for byte
with the committed files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted(PROTO_ROOT.rglob("*.proto"))


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc  # imported late so --help works without grpc-tools

    files = proto_files()
    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *[str(f.relative_to(PROTO_ROOT)) for f in files],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    # protoc writes no __init__.py; the generated modules import each other as forkrl.<svc>.v1.*.
    for f in files:
        rel_pkg = f.parent.relative_to(PROTO_ROOT)  # e.g. forkrl/rollout/v1
        for depth in range(2, len(rel_pkg.parts) + 1):  # skip forkrl/ itself: it is the core package
            (out / Path(*rel_pkg.parts[:depth]) / "__init__.py").touch()
        written += sorted((out / rel_pkg).glob("*_pb2*.py*"))
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
