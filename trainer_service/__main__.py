"""Start the trainer service.

    python -m trainer_service --host 127.0.0.1 --port 50052 --runs-root runs
    python -m trainer_service --help          # every flag; each also reads TRAINER_<FLAG>
    python -m forkrl.launch --nproc-per-node 2 -m trainer_service ...   # N ranks: rank 0 serves (docs/scaling.md)

The CLI is parsed before torch is imported, so --help and bad flags answer at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from forkrl.cli import parse_settings
    from trainer_service.config import TrainerSettings

    settings = parse_settings(TrainerSettings, argv)
    from trainer_service.server import serve

    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
