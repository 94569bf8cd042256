"""The kept-token breakdown by answer-token class (forkrl/training/metrics.py:class_breakdown): exact shares on a
hand-made batch, and through Policy.update on real tokens of the built-in tasks (tiny random model)."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forkrl.data.tasks import TASKS, make_split
from forkrl.models.tiny import build_tokenizer
from forkrl.training.config import RunConfig
from forkrl.training.metrics import class_breakdown
from forkrl.training.policy import Policy
from forkrl.training.scoring import ScoredBatch


def test_breakdown_arithmetic_on_a_hand_made_batch():
    labels = [["choice", "computed", "eos"], ["computed", "computed", "separator", "eos"]]
    kept = [[True, False, False], [True, True, False, False]]
    out = class_breakdown(labels, kept, ("choice", "computed", "separator", "eos", "other"))
    want = {
        # 3 kept tokens: 1 choice, 2 computed
        "kept_share_choice": Fraction(1, 3), "kept_share_computed": Fraction(2, 3),
        "kept_share_separator": 0, "kept_share_eos": 0, "kept_share_other": 0,
        # 7 tokens: 1 choice, 3 computed, 1 separator, 2 eos
        "all_share_choice": Fraction(1, 7), "all_share_computed": Fraction(3, 7),
        "all_share_separator": Fraction(1, 7), "all_share_eos": Fraction(2, 7), "all_share_other": 0,
        # kept / present, only for present classes
        "kept_rate_choice": 1, "kept_rate_computed": Fraction(2, 3), "kept_rate_separator": 0, "kept_rate_eos": 0,
    }
    assert out.keys() == want.keys()
    for k, v in want.items():
        assert out[k] == float(v), k  # each is one correctly rounded division


def test_breakdown_edges():
    classes = ("computed", "eos", "other")
    none_kept = class_breakdown([["computed", "eos"]], [[False, False]], classes)
    assert none_kept["kept_share_computed"] == 0.0 and none_kept["all_share_computed"] == 0.5
    assert class_breakdown([], [], classes) == {f"{w}_share_{c}": 0.0 for c in classes for w in ("kept", "all")}
    all_kept = class_breakdown([["computed", "eos", "eos"]], [[True, True, True]], classes)
    assert all(all_kept[f"kept_share_{c}"] == all_kept[f"all_share_{c}"] for c in classes)  # no mask: equal
    with pytest.raises(ValueError, match="same shape"):
        class_breakdown([["eos"]], [[True, False]], classes)
    with pytest.raises(ValueError, match=r"\['choice'\] are not among"):
        class_breakdown([["choice"]], [[True]], classes)


def _policy(task: str, frac: float | None) -> Policy:
    tok = build_tokenizer()
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    cfg = RunConfig(task=task, entropy_top_frac=frac, max_new_tokens=TASKS[task].max_new_tokens, group_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    return Policy(cfg, model, tok, opt, None, torch.device("cpu"), 0, 0, False)


def _scored(policy: Policy, task: str, texts: list[list[str]]) -> ScoredBatch:
    tok = policy.tokenizer
    problems = make_split(task, "eval", len(texts), seed=0)
    groups = []
    for p, g in zip(problems, texts, strict=True):
        group = []
        for text in g:
            ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            group.append(SimpleNamespace(prompt_token_ids=tok(p.prompt)["input_ids"], completion_token_ids=ids,
                                         logprobs=[-1.0] * len(ids), completion_text=text))
        groups.append(group)
    rewards = torch.tensor([[1.0, 0.0]] * len(groups))
    return ScoredBatch(groups, problems, rewards, rewards, 1, len(groups), len(groups), 0.0, 0.0)


def test_policy_update_logs_the_breakdown_for_sum3_and_countdown():
    # sum3 eval[0] is 0+9+58=: "9+58=67" is 1 computed + "+" + 2 copied + "=" + 2 computed + EOS; the second
    # sample breaks the format at "x" (other): 16 tokens, 5 computed, 4 copied, 4 separators, 2 EOS, 1 other
    policy = _policy("sum3", None)
    m = policy.update(_scored(policy, "sum3", [["9+58=67", "9+58=6x"]]), policy.cfg.loss_config())
    assert m["all_share_computed"] == 5 / 16 and m["all_share_copied"] == 4 / 16
    assert m["all_share_separator"] == 4 / 16 and m["all_share_eos"] == 2 / 16 and m["all_share_other"] == 1 / 16
    assert all(m[f"kept_share_{c}"] == m[f"all_share_{c}"] for c in TASKS["sum3"].classes)  # no mask
    assert "kept_share_choice" not in m  # sum3 has no choices

    policy = _policy("countdown", 0.2)
    batch = _scored(policy, "countdown", [["2+3=5,5*1=5", "3*1=3,3+2=5"], ["8+2=10,10*9=90", "9*9=81"]])
    m = policy.update(batch, policy.cfg.loss_config())
    n = sum(len(t.completion_token_ids) for t in batch.trajectories)
    assert m["all_share_eos"] == 4 / n and m["all_share_separator"] == (3 + 3 + 3 + 1) / n
    assert sum(m[f"kept_share_{c}"] for c in TASKS["countdown"].classes) == pytest.approx(1.0, abs=1e-12)
    kept = {c: round(m[f"kept_share_{c}"] * m["kept_tokens"]) for c in TASKS["countdown"].classes}
    assert sum(kept.values()) == m["kept_tokens"] < n  # the shares are counts of the kept tokens
    for c in TASKS["countdown"].classes:
        if f"kept_rate_{c}" in m:
            assert m[f"kept_rate_{c}"] == pytest.approx(kept[c] / round(m[f"all_share_{c}"] * n), abs=1e-12)


def test_no_breakdown_for_a_dataset():
    policy = _policy("sum3", None)
    policy.cfg = policy.cfg.model_copy(update={"task": "", "dataset": "/d.jsonl"})
    m = policy.update(_scored(policy, "sum3", [["9+58=67", "1"]]), policy.cfg.loss_config())
    assert not any(k.startswith(("kept_share_", "all_share_", "kept_rate_")) for k in m)


def test_mean_over_steps_and_the_demo_table():
    from clients.demo import class_table
    from forkrl.report.data import mean_class_breakdown

    classes = ("computed", "eos", "other")
    steps = [class_breakdown([["computed", "eos"]], [[True, False]], classes),
             class_breakdown([["computed", "computed", "other", "eos"]], [[True, False, True, False]], classes)]
    assert steps[0].keys() != steps[1].keys()  # kept_rate_other only where "other" occurred
    mean = mean_class_breakdown([{"step": 1, **steps[0]}, {"step": 2, **steps[1]}])
    assert mean["computed"] == {"all": (1 / 2 + 2 / 4) / 2, "kept": (1 + 1 / 2) / 2, "rate": (1 + 1 / 2) / 2}
    assert mean["other"] == {"all": (0 + 1 / 4) / 2, "kept": (0 + 1 / 2) / 2, "rate": 1.0}
    assert list(mean) == ["computed", "eos", "other"]  # the class order, whatever the key order
    assert list(mean_class_breakdown([dict(sorted(class_breakdown([], [], ("choice", "separator", "eos")).items()))])) \
        == ["choice", "separator", "eos"]
    assert mean["eos"]["rate"] == 0.0 and mean_class_breakdown([{"step": 1, "kept_frac": 0.2}]) == {}
    assert mean_class_breakdown([]) == {} and class_table([{"step": 1}]) == []
    table = class_table([{"step": 1, **steps[0]}])
    assert "share of kept tokens" in table[2]
    other = next(line for line in table[2].splitlines() if line.startswith("other"))
    assert other.split() == ["other", "0.000", "0.000", "-"]  # never occurred: no rate
