"""Serve a model for RL rollouts: vLLM's async engine behind gRPC (forkrl.rollout.v1.RolloutService).

    python -m rollout_service --model forkrl/models/default --port 50051
    python -m rollout_service --help          # every flag; each also reads ROLLOUT_<FLAG>

The CLI is parsed before torch/vLLM are imported, so --help and bad flags answer at once.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from forkrl.cli import parse_settings
    from rollout_service.config import RolloutSettings, apply_engine_env

    settings = parse_settings(RolloutSettings, argv)
    apply_engine_env(settings)  # read by vLLM/torch at import: before the imports below
    import asyncio
    import logging

    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from rollout_service.server import serve

    return asyncio.run(serve(settings))


if __name__ == "__main__":  # vLLM spawns processes that re-import the main module: keep this guard
    sys.exit(main())
