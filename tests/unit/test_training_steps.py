"""The steps run_training calls, in the core (forkrl/training): the scored batch with DAPO's dynamic-sampling
refill, reward scoring with the overlong penalty, preflight (the one resolve of a run config), the metrics sink
and the tied-tensor filter of the weight push. The rollout services are replaced by a scripted stand-in whose
answers are right or wrong by a rule the test states; the real services are exercised in tests/trainer."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from forkrl.data.order import DataOrder
from forkrl.data.rewards import exact_match
from forkrl.data.tasks import DEFAULT_TASK, get_task, make_split
from forkrl.seeds import run_seed
from forkrl.training.config import RunConfig
from forkrl.training.metrics import MetricsSink
from forkrl.training.preflight import preflight, resolve
from forkrl.training.rollouts import untie
from forkrl.training.scoring import ScoredBatch, collect_batch, score


class ScriptedRollouts:
    """Answers prompt i of call c, sample j, correctly iff right(c, i, j); records (prompt count, seed) per call."""

    def __init__(self, right) -> None:
        self.right = right
        self.calls: list[tuple[int, int]] = []

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        call = len(self.calls)
        self.calls.append((len(prompts), seed))
        groups = []
        for i, prompt in enumerate(prompts):
            total = sum(int(x) for x in prompt.rstrip("=").split("+"))
            groups.append([_trajectory(str(total if self.right(call, i, j) else total + 1)) for j in range(n)])
        return groups


def _trajectory(text: str, finish_reason: int = 1, version: int = 0, last_version: int | None = None
                ) -> SimpleNamespace:
    return SimpleNamespace(completion_text=text, completion_token_ids=list(range(len(text))),
                           finish_reason=finish_reason, policy_version=version,
                           last_policy_version=version if last_version is None else last_version)


TASK = "sum3"  # ScriptedRollouts computes sum3 answers from the prompt


def _cfg(**kw) -> RunConfig:
    return RunConfig(**{"task": TASK, "prompts_per_step": 4, "group_size": 3, "max_new_tokens": 8, "seed": 5, **kw})


@pytest.fixture
def data() -> DataOrder:
    return DataOrder(make_split(TASK, "train", 40, seed=0), seed=1)


def test_without_dynamic_sampling_one_round_keeps_every_group(data: DataOrder) -> None:
    rollouts = ScriptedRollouts(lambda c, i, j: i % 2 == 0 and j == 0)  # even prompts mixed, odd all wrong
    scored = collect_batch(rollouts, data, exact_match, _cfg(), step=7)
    assert rollouts.calls == [(4, run_seed("gen", 5, 7, 0))]
    assert data.cursor == 4 and len(scored.groups) == 4 and len(scored.problems) == 4
    assert scored.rewards.tolist() == [[1.0, 0.0, 0.0], [0.0] * 3, [1.0, 0.0, 0.0], [0.0] * 3]
    assert (scored.rounds, scored.seen_groups, scored.mixed_groups) == (1, 4, 2)
    m = scored.metrics()
    assert m["reward_mean"] == pytest.approx(2 / 12) and m["accuracy"] == pytest.approx(2 / 12)
    assert m["groups_mixed_frac"] == 0.5 and m["gen_rounds"] == 1.0 and m["groups_used"] == 4.0


def test_dynamic_sampling_keeps_mixed_groups_and_refills_up_to_the_batch(data: DataOrder) -> None:
    # call 0: prompts 0 and 3 mixed; call 1: prompts 0, 1, 2 mixed -> 5 kept, trimmed to 4
    mixed = {0: {0, 3}, 1: {0, 1, 2}}
    rollouts = ScriptedRollouts(lambda c, i, j: j == 0 and i in mixed[c])
    prompts = [p.prompt for p in DataOrder(data.problems, seed=1).take(8)]
    scored = collect_batch(rollouts, data, exact_match, _cfg(dynamic_sampling=True), step=2)
    assert rollouts.calls == [(4, run_seed("gen", 5, 2, 0)), (4, run_seed("gen", 5, 2, 1))]
    assert [p.prompt for p in scored.problems] == [prompts[0], prompts[3], prompts[4], prompts[5]]
    assert scored.rewards.tolist() == [[1.0, 0.0, 0.0]] * 4
    assert (scored.rounds, scored.seen_groups, scored.mixed_groups, data.cursor) == (2, 8, 5, 8)


def test_dynamic_sampling_stops_after_max_gen_batches_with_what_it_has(data: DataOrder) -> None:
    rollouts = ScriptedRollouts(lambda c, i, j: c == 1 and i == 2 and j == 1)  # one mixed group in 3 rounds
    scored = collect_batch(rollouts, data, exact_match, _cfg(dynamic_sampling=True, max_gen_batches=3), step=1)
    assert len(rollouts.calls) == 3 and scored.rounds == 3 and data.cursor == 12
    assert scored.rewards.tolist() == [[0.0, 1.0, 0.0]] and len(scored.groups) == 1

    none = collect_batch(ScriptedRollouts(lambda c, i, j: False), data, exact_match,
                         _cfg(dynamic_sampling=True, max_gen_batches=2), step=2)
    assert none.groups == [] and tuple(none.rewards.shape) == (0, 3)
    m = none.metrics()
    assert (m["groups_used"], m["reward_mean"], m["groups_mixed_frac"]) == (0.0, 0.0, 0.0)
    assert "response_len_mean" not in m  # no trajectories, no length statistics


def test_score_adds_the_soft_overlong_penalty() -> None:
    problems = make_split(DEFAULT_TASK, "train", 1, seed=0)
    answer = problems[0].answer
    # max_new_tokens 8, cache 4: no penalty up to 4 tokens, -(len - 4) / 4 up to 8
    groups = [[_trajectory(answer), _trajectory(answer + " " * (6 - len(answer))), _trajectory("x" * 8)]]
    correctness, rewards = score(exact_match, groups, problems, _cfg(overlong_cache_len=4, group_size=3))
    assert rewards.tolist() == [[1.0 - max(0, len(answer) - 4) / 4, 1.0 - 2 / 4, 0.0 - 4 / 4]]
    assert correctness.tolist() == [[1.0, 1.0, 0.0]]  # the grades, before the penalty
    plain_c, plain_r = score(exact_match, groups, problems, _cfg(group_size=3))
    assert plain_c.tolist() == plain_r.tolist() == [[1.0, 1.0, 0.0]]


class LengthRollouts:
    """Prompt i, sample j of call c: the right answer iff right[c][i][j], padded with spaces to lengths[c][i][j]
    tokens (one token per character, as `_trajectory`)."""

    def __init__(self, right, lengths) -> None:
        self.right, self.lengths, self.calls = right, lengths, 0

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        c, self.calls = self.calls, self.calls + 1
        groups = []
        for i, prompt in enumerate(prompts):
            total = sum(int(x) for x in prompt.rstrip("=").split("+"))
            texts = [str(total if self.right[c][i][j] else total + 1) for j in range(n)]
            groups.append([_trajectory(t + " " * (self.lengths[c][i][j] - len(t))) for j, t in enumerate(texts)])
        return groups


def test_dynamic_sampling_decides_on_correctness_before_the_overlong_penalty(data: DataOrder) -> None:
    # The case: prompt 0 is answered right twice, with 10 and 14 tokens; max_new_tokens 16 and an
    # overlong ramp of 8 make its rewards [1 - 2/8, 1 - 6/8] = [0.75, 0.25]: different rewards, yet every
    # sample is correct, so the group has no signal on correctness and DAPO drops it. Prompt 1 is mixed.
    rollouts = LengthRollouts(right=[[[1, 1], [1, 0]]], lengths=[[[10, 14], [3, 3]]])
    cfg = _cfg(prompts_per_step=2, group_size=2, max_new_tokens=16, overlong_cache_len=8, dynamic_sampling=True,
               max_gen_batches=1)
    scored = collect_batch(rollouts, data, exact_match, cfg, step=1)
    assert (scored.seen_groups, scored.mixed_groups, len(scored.groups)) == (2, 1, 1)
    assert scored.problems[0].prompt == DataOrder(data.problems, seed=1).take(2)[1].prompt
    assert scored.correctness.tolist() == [[1.0, 0.0]] and scored.rewards.tolist() == [[1.0, 0.0]]
    m = scored.metrics()
    assert m["accuracy"] == 0.5 and m["groups_mixed_frac"] == 0.5

    # without dynamic sampling both groups are trained on; accuracy counts correct answers, not reward > 0
    long_wrong = LengthRollouts(right=[[[1, 1], [1, 0]]], lengths=[[[10, 16], [3, 3]]])
    cfg = cfg.model_copy(update={"dynamic_sampling": False})
    scored = collect_batch(long_wrong, DataOrder(data.problems, seed=1), exact_match, cfg, step=1)
    assert scored.rewards.tolist() == [[0.75, 0.0], [1.0, 0.0]]  # 16 tokens: 1 - 8/8 = 0, yet correct
    assert scored.metrics()["accuracy"] == 0.75 and scored.mixed_groups == 1


def test_scored_batch_metrics_by_hand() -> None:
    groups = [[_trajectory("12", finish_reason=2, version=3), _trajectory("1234", version=4, last_version=5)]]
    scored = ScoredBatch(groups, [], torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0]]), rounds=1, seen_groups=1,
                         mixed_groups=1, time_generate_s=0.5, time_score_s=0.1)
    m = scored.metrics()
    assert m["response_len_mean"] == 3.0 and m["truncated_frac"] == 0.5 and m["rollout_policy_version"] == 3.0
    assert m["rollout_mixed_frac"] == 0.5  # one of two sampled across an in-place push (versions 4 and 5)
    assert m["reward_std"] == pytest.approx(2 ** -0.5) and scored.response_tokens == 6


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    return model


def test_resolve_fills_the_environment_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKRL_MODEL_DIR", str(tmp_path / "m"))
    cfg = resolve(RunConfig())
    assert (cfg.model, cfg.task, cfg.reward) == (str(tmp_path / "m"), DEFAULT_TASK, get_task(DEFAULT_TASK).reward)
    assert cfg.max_new_tokens == get_task(DEFAULT_TASK).max_new_tokens
    ds = resolve(RunConfig(dataset="/d.jsonl", max_new_tokens=0))
    assert (ds.task, ds.reward, ds.max_new_tokens) == ("", "math_verify", 1024)
    assert resolve(cfg) == cfg  # resolving twice changes nothing


def test_preflight_checks_before_the_run_starts(tmp_path: Path) -> None:
    model = _model_dir(tmp_path)
    ok = preflight(RunConfig(model=str(model), entropy_top_frac=0.2))
    assert ok.task == DEFAULT_TASK and ok.loss_config().entropy_top_frac == 0.2
    with pytest.raises(ValueError, match="not an HF checkpoint directory"):
        preflight(RunConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="dataset: no such file"):
        preflight(RunConfig(model=str(model), dataset=str(tmp_path / "nope.jsonl")))
    with pytest.raises(ValueError, match="clip_low is not used by loss 'reinforce'"):
        preflight(RunConfig(model=str(model), loss="reinforce", clip_low=0.1))
    with pytest.raises(FileNotFoundError, match="resume: no complete checkpoint"):
        preflight(RunConfig(model=str(model), run_dir=str(tmp_path / "run"), resume=True))


def test_metrics_sink_writes_one_sorted_line_per_call(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.write(1, {"b": 2.0, "a": 1.0})
    sink.write(1, {"eval_accuracy": 0.5}, kind="eval")
    sink.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines[0] == json.dumps({"a": 1.0, "b": 2.0, "kind": "train", "step": 1})
    assert json.loads(lines[1]) == {"step": 1, "kind": "eval", "eval_accuracy": 0.5}


def test_a_resume_drops_the_lines_of_steps_after_its_checkpoint(tmp_path: Path) -> None:
    sink = MetricsSink(tmp_path, tensorboard=False)
    for step in (0, 1, 2, 3):
        sink.write(step, {"x": float(step)}, kind="eval" if step == 0 else "train")
    assert sink.drop_after(3) == 0 and sink.drop_after(1) == 2  # steps 2 and 3 run again after a resume from 1
    sink.write(2, {"x": 20.0})
    lines = [json.loads(s) for s in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(m["step"], m["kind"], m["x"]) for m in lines] == [(0, "eval", 0.0), (1, "train", 1.0), (2, "train", 20.0)]
    assert MetricsSink(tmp_path / "new", tensorboard=False).drop_after(0) == 0  # no file yet


def test_a_line_a_full_disk_cuts_short_is_not_left_in_metrics_jsonl(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The soak's disk_full fault: the append of a step's line hit ENOSPC halfway, the run failed, and every resume
    then failed reading metrics.jsonl (JSONDecodeError). A failed write leaves the file as it was; a tail torn by
    the old code is dropped by the resume (that step runs again)."""
    import errno
    import os

    sink = MetricsSink(tmp_path, tensorboard=False)
    sink.write(1, {"x": 1.0})
    real_write = os.write
    calls = []

    def full_disk(fd: int, data: bytes) -> int:  # the disk takes 10 bytes, then is full
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[:10]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        sink.write(2, {"x": 2.0})
    monkeypatch.undo()
    assert calls and (tmp_path / "metrics.jsonl").read_text() == json.dumps({"kind": "train", "step": 1, "x": 1.0}) \
        + "\n"
    with open(tmp_path / "metrics.jsonl", "a") as f:  # what the old write left behind
        f.write('{"kind": "train", "st')
    assert sink.drop_after(1) == 1
    sink.write(2, {"x": 2.0})
    assert [json.loads(s)["step"] for s in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_untie_drops_tensors_that_share_storage() -> None:
    emb = torch.randn(5, 3)
    state = {"embed.weight": emb, "lm_head.weight": emb, "norm.weight": torch.ones(3), "view": emb[1:]}
    assert list(untie(state)) == ["embed.weight", "norm.weight", "view"]  # a different offset is a different tensor


def test_evaluate_per_prompt_accuracies_average_to_the_totals() -> None:
    from forkrl.training.scoring import evaluate

    problems = make_split(TASK, "eval", 3, seed=0)
    # T=1 (call 0, 4 samples): prompt i has i + 1 right samples; greedy (call 1): only prompt 1 is right
    rollouts = ScriptedRollouts(lambda c, i, j: j <= i if c == 0 else i == 1)
    per_prompt: dict[str, list[float]] = {}
    sampled: list = []  # the run report's eval sample: each prompt's samples at T with their rewards
    out = evaluate(rollouts, exact_match, problems, _cfg(), per_prompt=per_prompt, sampled=sampled)
    assert per_prompt == {"eval_accuracy": [0.25, 0.5, 0.75], "eval_greedy_accuracy": [0.0, 1.0, 0.0]}
    assert [len(g) for g, _ in sampled] == [4, 4, 4] and [sum(r) for _, r in sampled] == [1.0, 2.0, 3.0]
    assert out == {"eval_accuracy": 6 / 12, "eval_greedy_accuracy": 1 / 3}
    assert rollouts.calls == [(3, run_seed("eval", 5)), (3, run_seed("eval", 5))]
    assert evaluate(ScriptedRollouts(lambda c, i, j: True), exact_match, problems, _cfg()) == {
        "eval_accuracy": 1.0, "eval_greedy_accuracy": 1.0}  # without per_prompt: the totals only


class StoppingRollouts(ScriptedRollouts):
    """ScriptedRollouts that sets the run's stop flag during its call number `at` (a StopRun mid-Generate)."""

    def __init__(self, right, at: int) -> None:
        super().__init__(right)
        self.at, self.stop = at, False

    def generate(self, prompts, n, temperature, max_new_tokens, seed):
        if len(self.calls) == self.at:
            self.stop = True
        return super().generate(prompts, n, temperature, max_new_tokens, seed)


def test_a_stop_ends_dynamic_sampling_before_its_next_generate_call(data: DataOrder) -> None:
    from forkrl.training.scoring import SamplingStopped

    rollouts = StoppingRollouts(lambda c, i, j: False, at=1)  # never a mixed group: it would draw 5 rounds
    with pytest.raises(SamplingStopped, match="round 3 of step 4"):
        collect_batch(rollouts, data, exact_match, _cfg(dynamic_sampling=True, max_gen_batches=5), step=4,
                      stop=lambda: rollouts.stop)
    assert len(rollouts.calls) == 2  # the call in flight finished; none after it
    stopped = StoppingRollouts(lambda c, i, j: False, at=0)
    stopped.stop = True
    with pytest.raises(SamplingStopped, match="round 1"):
        collect_batch(stopped, data, exact_match, _cfg(), step=5, stop=lambda: stopped.stop)
    assert stopped.calls == []


def test_a_stop_ends_an_evaluation_between_its_two_generate_calls() -> None:
    from forkrl.training.scoring import SamplingStopped, evaluate

    rollouts = StoppingRollouts(lambda c, i, j: True, at=0)
    with pytest.raises(SamplingStopped, match="eval_greedy_accuracy"):
        evaluate(rollouts, exact_match, make_split(TASK, "eval", 3, seed=0), _cfg(), stop=lambda: rollouts.stop)
    assert len(rollouts.calls) == 1
