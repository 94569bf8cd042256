"""Run options end to end, with assertions on metrics.jsonl that hold for any model and any samples:
weight sync through the run dir, DAPO dynamic sampling, the k3 KL term, learning-rate warm-up, periodic
evaluation; a JSONL dataset graded by math-verify with DAPO's overlong penalty; and a second rollout
engine: synced before a run on another model, sharded over, pushed to, then stopped with SIGTERM.

Options are combined into few short runs to keep the suite fast.
"""

from __future__ import annotations

import json
import math
import signal
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from forkrl.remote.rollout import RolloutClient
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
        group_size=4, eval_prompts=8, loss="dapo", mini_batch_prompts=3, ppo_epochs=2, tis_cap=2.0,
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
        # mini-batches of 3, 3 and 2 prompts, two epochs: six AdamW updates on the same batch. π_old is the
        # served policy, so the truncated-IS ratio is the engine's float32 gap only (below the cap 2).
        assert m["n_updates"] == 6.0 and m["micro_batches"] == 3.0
        assert m["tis_ratio_max"] <= math.exp(logp_ceiling) and m["tis_capped_frac"] == 0.0
    for e in _check_evals(run_dir, [0, 2], prompts=8):
        assert e["eval_accuracy"] == e["eval_greedy_accuracy"] == 0.0


def _perturbed_copy(model_dir: Path, out: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, use_safetensors=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return out


def _max_logp_gap(a: Path, b: Path) -> float:
    """max |logp_a - logp_b| over greedy completions of model a on the default task (teacher-forced in both,
    float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from forkrl.data.tasks import DEFAULT_TASK, get_task, make_split
    from forkrl.models.tiny import sample_completions
    from tests.numerics import reference_logprobs

    tok = AutoTokenizer.from_pretrained(a)
    ma, mb = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in (a, b))
    prompts = [p.prompt for p in make_split(DEFAULT_TASK, "eval", 16, seed=3)]
    gap = 0.0
    max_new = get_task(DEFAULT_TASK).max_new_tokens
    for p, (c,) in zip(prompts, sample_completions(ma, tok, prompts, temperature=0.0, max_new_tokens=max_new),
                       strict=True):
        ids = (tok(p).input_ids, tok(c, add_special_tokens=False).input_ids + [tok.eos_token_id])
        gap = max(gap, float((reference_logprobs(ma, *ids, 1.0)[0] - reference_logprobs(mb, *ids, 1.0)[0]).abs().max()))
    return gap


def test_a_second_rollout_engine_synced_sharded_pushed_and_stopped(
    rollout_address, trainer, tiny_model_dir, tmp_path, logp_ceiling
) -> None:
    """A fresh second rollout service: (1) at version 0 it serves the tiny model, and a run on another
    checkpoint must push that checkpoint before its first Generate (else step 1 trains on samples of a
    policy it is not training); (2) prompts sharded over two engines sample exactly as on one; (3) a run
    on both engines pushes every version to both; (4) SIGTERM stops it and its engine cleanly.
    One engine start serves the four checks (~30 s each on 2 cores)."""
    from forkrl.training.rollouts import Rollouts
    from tests.numerics import float32_logprob_bound

    with start_rollout_service(tiny_model_dir, seed=0, staging_dir=tmp_path / "staging",
                               log_path=tmp_path / "second.log") as second:
        # (1) the initial sync
        other = _perturbed_copy(tiny_model_dir, tmp_path / "perturbed")
        assert _info(second).version == 0
        cfg = RunConfig(model=str(other), rollout_addresses=[second], num_steps=1, run_dir=str(tmp_path / "other"),
                        prompts_per_step=8, group_size=4, eval_prompts=0)
        _, _, run = run_to_end(trainer[0], cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        assert _info(second).version == 2  # the initial sync + the step's push
        (m,) = metric_lines(tmp_path / "other")
        other_ceiling = trainer_rollout_logp_ceiling(other)
        assert m["logp_delta_max"] <= other_ceiling  # step 1 was sampled from exactly the policy being trained
        gap = _max_logp_gap(tiny_model_dir, other)  # ... which the ceiling tells apart from the tiny model
        assert gap > 10 * other_ceiling, (gap, other_ceiling)

        # (2) both engines serve the same weights (each may hold another run's policy now), then sharding
        # prompts over them must not change a sample: seeds follow the global prompt index, so runs and
        # resumes do not depend on how many rollout services there are
        base = load_file(str(tiny_model_dir / "model.safetensors"))
        for address in (rollout_address, second):
            with RolloutClient(address, timeout_s=120) as c:
                c.update_weights(base, c.info().version + 1)
        prompts = [f"{a}+{b}+{c}=" for a, b, c in ((1, 2, 3), (45, 6, 78), (9, 90, 9), (12, 34, 56), (7, 0, 70))]
        groups = []
        for addresses in ([rollout_address], [rollout_address, second]):
            r = Rollouts(addresses)
            try:
                groups.append(r.generate(prompts, n=3, temperature=1.0, max_new_tokens=11, seed=42))
            finally:
                r.executor.shutdown()
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

        # (3) a run on both engines: prompts spread over both, every push reaches both
        before = [_info(x).counters.samples for x in (rollout_address, second)]
        versions = [_info(x).version for x in (rollout_address, second)]
        run_dir = tmp_path / "two"
        cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address, second],
                        run_dir=str(run_dir), num_steps=2, prompts_per_step=8, group_size=4, eval_prompts=0)
        _, _, run = run_to_end(trainer[0], cfg)
        assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
        infos = [_info(x) for x in (rollout_address, second)]
        # initial sync + 2 steps on both (each numbers its own versions: a push is its served version + 1)
        assert [i.version - v for i, v in zip(infos, versions, strict=True)] == [3, 3]
        assert [i.counters.samples - b for i, b in zip(infos, before, strict=True)] == [2 * 4 * 4, 2 * 4 * 4]
        assert all(m["logp_delta_max"] <= logp_ceiling for m in metric_lines(run_dir))

        # (4) SIGTERM: the service stops gracefully (status 0) and its engine processes with it
        second.process.send_signal(signal.SIGTERM)
        assert second.process.wait(timeout=60) == 0
        wait_until(lambda: not group_alive(second.process.pid), 30, "the engine processes to exit")
        with pytest.raises(grpc.RpcError):
            _info(second)


def test_async_rollouts_sample_ahead_within_the_staleness_bound(rollout_address, trainer, tiny_model_dir,
                                                                tmp_path) -> None:
    """max_staleness 1: step s + 1 is sampled while step s trains; every trajectory is trained at most one
    policy version after it was sampled, no batch is sampled past the last step, and the checkpoint stores the
    data cursor of the last trained batch (not of the sampler, which runs ahead)."""
    run_dir = tmp_path / "async"
    cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address], run_dir=str(run_dir), seed=0,
                    num_steps=4, prompts_per_step=8, group_size=4, entropy_top_frac=0.2, loss="dapo",
                    max_staleness=1, tis_cap=2.0, eval_prompts=0)
    before = _info(rollout_address).counters.samples
    _, _, run = run_to_end(trainer[0], cfg)
    assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    assert _info(rollout_address).counters.samples - before == 4 * 8 * 4  # exactly the 4 steps' batches
    lines = metric_lines(run_dir)
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    versions = [int(m["policy_version"]) for m in lines]
    assert versions == list(range(versions[0], versions[0] + 4))  # one push per step
    for m, v in zip(lines, versions, strict=True):
        # trained at version v - 1 (pushed v after it): sampled at v - 1 or v - 2, never older
        assert m["staleness_max"] <= 1 and m["stale_batches_dropped"] == 0
        assert v - 2 <= m["rollout_policy_version"] <= v - 1
        assert m["data_cursor"] == 8 * m["step"]  # the trained batches' prompts, not the sampler's
        assert m["tis_weight_mean"] > 0 and m["n_updates"] == 1.0
        assert m["swap_drain_s"] >= 0 and m["swap_apply_s"] > 0  # the stall of generation per push, measured
    state = json.loads((run_dir / "checkpoints" / "final" / "trainer_state.json").read_text())
    assert state["data_cursor"] == 32 and state["step"] == 4
