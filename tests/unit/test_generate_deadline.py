"""The trainer's Generate deadline grows with the tokens a call may generate (forkrl/training/rollouts.py): the fixed
600 s of RolloutClient ended every long-response batch that took longer with DEADLINE_EXCEEDED, failing the run."""

from __future__ import annotations

from types import SimpleNamespace

from forkrl.training.rollouts import GENERATE_BASE_S, Rollouts, generate_deadline_s


class _Client:
    """The one seam: records what Rollouts.generate asks each service for, answers n samples per prompt."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def close(self) -> None:
        pass

    def generate(self, prompts, n, temperature, max_new_tokens, seed, prompt_offsets, timeout_s=None):
        self.calls.append(dict(prompts=len(prompts), n=n, max_new_tokens=max_new_tokens, timeout_s=timeout_s))
        for i in range(len(prompts)):
            for j in range(n):
                yield SimpleNamespace(prompt_index=i, sample_index=j, policy_version=0, last_policy_version=-1)


def test_the_deadline_grows_with_the_tokens_asked() -> None:
    assert generate_deadline_s(2, 2, 16) < GENERATE_BASE_S + 10  # a short batch: about the old 600 s
    # the dapo_paper recipe's batch on one service: 512 x 16 x 20,480 tokens, > 4 h at 10,000 tokens/s
    assert generate_deadline_s(512, 16, 20480) > 512 * 16 * 20480 / 10_000


def test_each_service_gets_the_deadline_of_its_share() -> None:
    rollouts = Rollouts(["127.0.0.1:1", "127.0.0.1:2"], token="")
    try:
        rollouts.clients = [_Client(), _Client()]
        groups = rollouts.generate([f"p{i}" for i in range(5)], n=4, temperature=1.0, max_new_tokens=20480, seed=0)
        assert [len(g) for g in groups] == [4] * 5
        calls = [c.calls[0] for c in rollouts.clients]
        assert [c["prompts"] for c in calls] == [3, 2]
        for c in calls:
            assert c["timeout_s"] == generate_deadline_s(c["prompts"], 4, 20480) > 600, c
    finally:
        rollouts.close()
