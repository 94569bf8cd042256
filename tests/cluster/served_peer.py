"""A client of a rollout service on another simulated host (run there by tests/cluster/test_push_across_hosts.py).

    FORKRL_TLS_CA=ca.pem FORKRL_TOKEN=... python tests/cluster/served_peer.py wait 10.210.0.12:PORT
    FORKRL_TLS_CA=ca.pem FORKRL_TOKEN=... python tests/cluster/served_peer.py generate 10.210.0.12:PORT PROMPT...

wait: until the service is ready (TLS, token). generate: one JSON line, {"version": the service's version,
"trajectories": [{prompt_token_ids, completion_token_ids, logprobs, policy_version}, ...]} (n=4 per prompt,
temperature 1, 24 tokens, seed 9).
"""

from __future__ import annotations

import json
import sys

from forkrl.remote.rollout import RolloutClient


def main(mode: str, address: str, prompts: list[str]) -> int:
    with RolloutClient(address, timeout_s=120) as client:
        client.wait_ready(timeout_s=300)
        if mode == "generate":
            trajs = list(client.generate(prompts, n=4, temperature=1.0, max_new_tokens=24, seed=9))
            print(json.dumps({"version": client.info().version, "trajectories": [
                {"prompt_token_ids": list(t.prompt_token_ids), "completion_token_ids": list(t.completion_token_ids),
                 "logprobs": list(t.logprobs), "policy_version": t.policy_version} for t in trajs]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
