"""Start the trainer service.

    python -m trainer_service --host 127.0.0.1 --port 50052 --runs-root runs

Every flag can also be set as TRAINER_<FLAG> in the environment (e.g. TRAINER_PORT=50052).
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from trainer_service.config import parse_settings

    settings = parse_settings(argv)  # parses (and answers --help) before torch is imported
    from trainer_service.server import serve

    return serve(settings)


if __name__ == "__main__":
    sys.exit(main())
