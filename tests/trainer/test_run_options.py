"""Run options end to end, with assertions on metrics.jsonl that hold for any model and any samples:
weight sync through the run dir, DAPO dynamic sampling, the k3 KL term, learning-rate warm-up, periodic
evaluation; a JSONL dataset graded by math-verify with DAPO's overlong penalty; and two separate rollout
engines (prompts sharded over both, weights pushed to both), one of which is then stopped with SIGTERM.

Options are combined into few short runs to keep the suite fast.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from forkrl.clients.rollout import RolloutClient
from forkrl.training.config import RunConfig
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.service_fixtures import group_alive, start_rollout_service, wait_until
from tests.trainer.helpers import metric_lines, run_to_end, trainer_rollout_logp_ceiling

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def logp_ceiling(tiny_model_dir: Path) -> float:
    return trainer_rollout_logp_ceiling(tiny_model_dir)


def _info(address: str):
    with RolloutClient(address, timeout_s=60) as c:
        return c.info()


def _check_evals(run_dir: Path, steps: list[int], prompts: int, samples: int = 4) -> list[dict]:
    evals = metric_lines(run_dir, "eval")
    assert [e["step"] for e in evals] == steps
    for e in evals:
        # accuracies are counts over prompts x samples (T = 1) and prompts (greedy): exact multiples
        for key, n in (("eval_accuracy", prompts * samples), ("eval_greedy_accuracy", prompts)):
            assert 0.0 <= e[key] <= 1.0 and e[key] * n == round(e[key] * n), (key, e[key])
    return evals


def test_path_sync_dynamic_sampling_kl_warmup_and_eval_every(rollout_address, trainer, tiny_model_dir, tmp_path,
                                                            logp_ceiling) -> None:
    run_dir = tmp_path / "opts"
    cfg = RunConfig(
        model=str(tiny_model_dir), rollout_addresses=[rollout_address], run_dir=str(run_dir), seed=0,
        num_steps=3, prompts_per_step=8, group_size=4, entropy_top_frac=0.2, lr=3e-4,
        weight_sync="path", dynamic_sampling=True, max_gen_batches=3, kl_beta=0.05, warmup_steps=2,
        eval_every=1, eval_prompts=8,
    )
    v0 = _info(rollout_address).version
    _, _, run = run_to_end(trainer[0], cfg)
    assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3]

    for m in lines:
        step = m["step"]
        # warm-up: lr ramps linearly over warmup_steps, then stays
        assert m["lr"] == pytest.approx(cfg.lr * min(1.0, step / cfg.warmup_steps), rel=1e-12)
        # dynamic sampling: up to max_gen_batches rounds of 8 groups; the mixed groups found are used, at
        # most 8, and sampling stops early only once there are 8
        rounds, used = int(m["gen_rounds"]), int(m["groups_used"])
        mixed = m["groups_mixed_frac"] * rounds * cfg.prompts_per_step
        assert 1 <= rounds <= cfg.max_gen_batches and abs(mixed - round(mixed)) < 1e-9
        assert used == min(round(mixed), cfg.prompts_per_step)
        assert rounds == cfg.max_gen_batches or used == cfg.prompts_per_step
        # a group of 4 samples is all-right or all-wrong with probability < 1/2 for any accuracy the
        # built model can have, so 24 groups without a mixed one (p < 1e-7) would be a bug
        assert used >= 1
        assert 0.0 < m["accuracy"] < 1.0 and m["reward_std"] > 0  # only mixed groups are trained on
        assert m["logp_delta_max"] <= logp_ceiling  # the rollout loaded exactly the pushed checkpoint
    # k3 KL against the initial policy: float32 noise at step 1 (the same weights: k3 ~ d^2 / 2 for a
    # log-prob difference d <= 1e-4), clearly positive once two updates moved the policy
    assert lines[0]["kl_mean"] < 1e-8 < lines[2]["kl_mean"]

    # path sync: every push went through run_dir/weights_sync (LoadWeights); the last one is the final policy
    synced = load_file(str(run_dir / "weights_sync" / "model.safetensors"))
    final = load_file(str(run_dir / "checkpoints" / "final" / "model.safetensors"))
    assert synced.keys() == final.keys() and all(torch.equal(synced[k], final[k]) for k in final)
    assert _info(rollout_address).version == v0 + 3 + (v0 != 0)
    _check_evals(run_dir, [0, 1, 2, 3], prompts=8)  # eval_every 1: before, after steps 1 and 2, final


def test_dataset_with_math_verify_and_the_overlong_penalty(rollout_address, trainer, tiny_model_dir, tmp_path,
                                                           logp_ceiling) -> None:
    """Every problem of the dataset has a 7-token prompt (BOS + 'a+b+c='), which no mix of the built-in
    task's prompts gives: the rollout's token counters show that the dataset is what was sampled."""
    dataset = tmp_path / "one_digit.jsonl"
    dataset.write_text("".join(
        json.dumps({"question": f"{a}+{b}+{c}=", "answer": str(a + b + c)}) + "\n"
        for a in range(10) for b in range(10) for c in range(10)
    ))
    run_dir = tmp_path / "ds"
    cfg = RunConfig(
        model=str(tiny_model_dir), rollout_addresses=[rollout_address], run_dir=str(run_dir), seed=0,
        dataset=str(dataset), max_new_tokens=11, overlong_cache_len=11, num_steps=2, prompts_per_step=8,
        group_size=4, eval_prompts=8,
    )
    before = _info(rollout_address).counters
    _, _, run = run_to_end(trainer[0], cfg)
    assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    after = _info(rollout_address).counters
    samples = after.samples - before.samples
    assert samples == (2 * 8 * 4) + 2 * (8 * 4 + 8)  # two steps; two evals (T = 1 x 4 and greedy)
    assert after.prompt_tokens - before.prompt_tokens == 7 * samples

    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["dataset"] == str(dataset) and resolved["reward"] == "math_verify"  # a dataset's default
    for m in metric_lines(run_dir):
        # math-verify grades the last \boxed{}, which the tiny model never writes: every answer scores 0.
        # With the overlong ramp as long as max_new_tokens (L_max = L_cache = 11) the penalty is -len/11 for
        # every sample, so the mean reward is exactly -mean length / 11.
        assert m["accuracy"] == 0.0
        assert m["reward_mean"] == pytest.approx(-m["response_len_mean"] / 11, rel=1e-5)
        assert m["logp_delta_max"] <= logp_ceiling
    for e in _check_evals(run_dir, [0, 2], prompts=8):
        assert e["eval_accuracy"] == e["eval_greedy_accuracy"] == 0.0


def test_two_rollout_engines_shard_prompts_get_every_push_and_stop_on_sigterm(
    rollout_address, trainer, tiny_model_dir, tmp_path, logp_ceiling
) -> None:
    from tests.numerics import float32_logprob_bound
    from trainer_service.loop import Rollouts

    base = load_file(str(tiny_model_dir / "model.safetensors"))
    with start_rollout_service(tiny_model_dir, seed=0, staging_dir=tmp_path / "staging",
                               log_path=tmp_path / "second.log") as second:
        # both engines serve the same weights: the shared one may hold another test's policy
        with RolloutClient(rollout_address, timeout_s=120) as a:
            a.update_weights(base, a.info().version + 1)
        # Sharding prompts over engines must not change a sample: seeds follow the global prompt index,
        # so runs and resumes do not depend on how many rollout services there are.
        prompts = [f"{a}+{b}+{c}=" for a, b, c in ((1, 2, 3), (45, 6, 78), (9, 90, 9), (12, 34, 56), (7, 0, 70))]
        groups = []
        for addresses in ([rollout_address], [rollout_address, second]):
            r = Rollouts(addresses)
            try:
                groups.append(r.generate(prompts, n=3, temperature=1.0, max_new_tokens=11, seed=42))
            finally:
                r.pool.shutdown()
                for c in r.clients:
                    c.close()
        one, two = ([t for g in gs for t in g] for gs in groups)
        assert [list(t.completion_token_ids) for t in one] == [list(t.completion_token_ids) for t in two]
        assert [list(t.prompt_token_ids) for t in one] == [list(t.prompt_token_ids) for t in two]
        from transformers import AutoModelForCausalLM

        m32, m64 = (AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=d).eval()
                    for d in (torch.float32, torch.float64))
        bound = float32_logprob_bound([(t.prompt_token_ids, t.completion_token_ids) for t in one], m32, m64, 1.0)
        # two float32 engines, each within `bound` of the exact log-probs
        assert max(abs(x - y) for s, t in zip(one, two, strict=True)
                   for x, y in zip(s.logprobs, t.logprobs, strict=True)) <= 2 * bound

        # a run on both engines: prompts spread over both, every push reaches both
        before = [_info(x).counters.samples for x in (rollout_address, second)]
        run_dir = tmp_path / "two"
        cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address, second],
                        run_dir=str(run_dir), num_steps=2, prompts_per_step=8, group_size=4, eval_prompts=0)
        _, _, run = run_to_end(trainer[0], cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        infos = [_info(x) for x in (rollout_address, second)]
        assert infos[0].version == infos[1].version  # initial sync + 2 steps, the same versions on both
        assert [i.counters.samples - b for i, b in zip(infos, before, strict=True)] == [2 * 4 * 4, 2 * 4 * 4]
        assert all(m["logp_delta_max"] <= logp_ceiling for m in metric_lines(run_dir))

        # SIGTERM: the service stops gracefully (status 0) and its engine processes with it
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=60) == 0
        wait_until(lambda: not group_alive(second.process.pid), 30, "the engine processes to exit")
        with pytest.raises(grpc.RpcError):
            _info(second)
