"""The eval gain's paired bootstrap and the curve PNGs (forkrl/training/curves.py), the demo's gain line, and
bench/bench_learning.py's argument handling. No learning numbers: exact arithmetic and file formats only."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from forkrl.training.curves import eval_gain, mean_sd, paired_bootstrap, plot_arm_curves, plot_run_curve
from forkrl.training.metrics import EVAL_PROMPTS_FILE, MetricsSink

REPO_ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_identical_before_and_after_give_a_zero_interval():
    before = [0.0, 0.25, 0.5, 1.0, 0.75]
    g = paired_bootstrap(before, before, draws=500, seed=3)
    assert (g["mean"], g["lo"], g["hi"]) == (0.0, 0.0, 0.0)
    assert g["n_prompts"] == 5 and g["before"] == g["after"] == 0.5


def test_a_constant_shift_is_the_interval_exactly():
    before = [0.0, 0.25, 0.5, 0.25]
    after = [b + 0.25 for b in before]  # every difference is exactly 0.25 (dyadic: no rounding)
    g = paired_bootstrap(before, after, draws=300, seed=0)
    assert (g["mean"], g["lo"], g["hi"]) == (0.25, 0.25, 0.25)
    assert (g["before"], g["after"]) == (0.25, 0.5)


def test_pairing_is_kept_when_resampling():
    # resampling before and after independently would give means from -0.5 to +1.0; paired, every prompt moved
    # by exactly +0.5, so every draw's mean is 0.5
    before = [0.0, 0.5]
    after = [0.5, 1.0]
    g = paired_bootstrap(before, after, draws=200, seed=1)
    assert (g["lo"], g["hi"]) == (0.5, 0.5)


def test_interval_matches_a_slow_reference():
    rng = np.random.default_rng(7)
    before = rng.integers(0, 5, size=40) / 4
    after = rng.integers(0, 5, size=40) / 4
    g = paired_bootstrap(before, after, draws=400, seed=11)
    draw_rng = np.random.default_rng(11)
    idx = draw_rng.integers(0, 40, size=(400, 40))
    means = sorted(sum(after[i] - before[i] for i in row) / 40 for row in idx)
    # numpy's default quantile: linear between order statistics at (n - 1) * q
    def q(p: float) -> float:
        h = (len(means) - 1) * p
        lo = int(np.floor(h))
        return means[lo] + (h - lo) * (means[min(lo + 1, len(means) - 1)] - means[lo])
    assert g["lo"] == pytest.approx(q(0.025), abs=1e-12)
    assert g["hi"] == pytest.approx(q(0.975), abs=1e-12)
    assert g["lo"] <= g["mean"] <= g["hi"]
    assert g["mean"] == pytest.approx(float(np.mean(after - before)), abs=1e-15)


def test_bootstrap_rejects_bad_input():
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([0.0, 1.0], [1.0])
    with pytest.raises(ValueError, match="equal-length"):
        paired_bootstrap([], [])
    with pytest.raises(ValueError, match="draws"):
        paired_bootstrap([0.0], [1.0], draws=0)


def test_eval_gain_reads_first_and_last_eval_of_a_run(tmp_path: Path):
    sink = MetricsSink(tmp_path, tensorboard=False)
    assert eval_gain(tmp_path) is None
    sink.write_eval_prompts(0, {"eval_accuracy": [0.0, 0.25], "eval_greedy_accuracy": [0.0, 1.0]})
    assert eval_gain(tmp_path) is None  # one evaluation: no gain
    sink.write_eval_prompts(30, {"eval_accuracy": [0.5, 0.25], "eval_greedy_accuracy": [1.0, 1.0]})
    sink.write_eval_prompts(60, {"eval_accuracy": [0.5, 0.75], "eval_greedy_accuracy": [1.0, 1.0]})
    sink.write_eval_prompts(61, {})  # nothing written for an empty evaluation
    assert len((tmp_path / EVAL_PROMPTS_FILE).read_text().splitlines()) == 3
    g = eval_gain(tmp_path, draws=100)
    assert (g["step_before"], g["step_after"], g["mean"], g["n_prompts"]) == (0, 60, 0.5, 2)
    assert (g["lo"], g["hi"]) == (0.5, 0.5)  # both prompts moved by +0.5
    assert eval_gain(tmp_path, key="eval_greedy_accuracy", draws=100)["mean"] == 0.5


def test_mean_sd():
    assert mean_sd([1.0, 3.0]) == (2.0, 2.0 ** 0.5)
    assert mean_sd([0.5]) == (0.5, 0.0)


def _assert_png(path: Path) -> None:
    assert path.is_file()
    assert path.read_bytes()[:8] == PNG_MAGIC
    assert not path.with_name(path.name + ".tmp").exists()


def test_run_curve_png(tmp_path: Path):
    lines = [{"step": 0, "kind": "eval", "eval_accuracy": 0.25, "eval_greedy_accuracy": 0.375}]
    lines += [{"step": s, "kind": "train", "reward_mean": 0.25 + s / 100} for s in range(1, 21)]
    lines += [{"step": 20, "kind": "eval", "eval_accuracy": 0.4, "eval_greedy_accuracy": 0.5}]
    _assert_png(plot_run_curve(tmp_path / "sub" / "curve.png", lines, title="t"))
    _assert_png(plot_run_curve(tmp_path / "empty.png", []))  # nothing to draw still writes a valid file


def test_arm_curves_png_with_one_two_and_three_seeds(tmp_path: Path):
    arms = {
        "a": [[(0, 0.2), (50, 0.3)]],
        "b": [[(0, 0.2), (50, 0.35)], [(0, 0.22), (50, 0.31)]],
        "c": [[(0, 0.2), (50, 0.3), (100, 0.4)], [(0, 0.2), (50, 0.4)], [(0, 0.2), (50, 0.5)]],
        "d": [],
    }
    _assert_png(plot_arm_curves(tmp_path / "arms.png", arms, title="x"))


# ---- bench/bench_learning.py: arguments ----

@pytest.fixture()
def bench():
    sys.path.insert(0, str(REPO_ROOT / "bench"))
    try:
        import bench_learning

        yield bench_learning
    finally:
        sys.path.remove(str(REPO_ROOT / "bench"))


def test_bench_defaults_and_seeds(bench, tmp_path: Path):
    a = bench.parse_args(["--data-dir", str(tmp_path)])
    assert a.arms == ["top20", "full", "async", "mb4"] and a.seeds == [0]
    assert a.out == tmp_path / "results.json" and a.plot == tmp_path / "learning_curves.png"
    a = bench.parse_args(["--seeds", "0", "1", "2", "1", "--arms", "async", "top20", "async"])
    assert a.seeds == [0, 1, 2] and a.arms == ["async", "top20"]


@pytest.mark.parametrize("argv", [["--arms", "nope"], ["--seeds", "-1"], ["--seeds"], ["--arms"],
                                  ["--arms", "mb4", "--prompts-per-step", "30"]])
def test_bench_rejects_bad_arguments(bench, argv: list[str]):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(argv)
    assert e.value.code == 2


def test_bench_arm_configs(bench):
    from forkrl.training.config import RunConfig

    assert bench.arm_config("top20", 32) == {"entropy_top_frac": 0.2}
    assert bench.arm_config("full", 32) == {"entropy_top_frac": None}
    assert bench.arm_config("async", 32) == {"entropy_top_frac": 0.2, "max_staleness": 1}
    assert bench.arm_config("mb4", 32) == {"entropy_top_frac": 0.2, "mini_batch_prompts": 8}
    assert bench.arm_config("mb4", 16)["mini_batch_prompts"] == 4
    for arm in bench.ARMS:  # every arm is a valid run config
        RunConfig(prompts_per_step=32, **bench.arm_config(arm, 32))


def test_bench_tables_and_plot(bench, tmp_path: Path):
    def res(arm: str, seed: int, before: float, after: float, step_s: float) -> dict:
        return {"arm": arm, "seed": seed, "acc_before": before, "acc_after": after, "greedy_before": 0.3,
                "greedy_after": 0.4, "step_s": step_s, "wall_s": 10.0, "kept_frac": 0.2, "updates": 1.0,
                "gain": None, "curve": [(0, before, 0.3), (10, after, 0.4)], "classes": {},
                "settings": {"task": "sum3", "loss": "grpo", "steps": 10, "prompts_per_step": 32, "group_size": 8,
                             "lr": 3e-4, "eval_prompts": 64}}

    results = [res("top20", 0, 0.25, 0.5, 1.0), res("async", 0, 0.25, 0.375, 0.5),
               res("top20", 1, 0.25, 0.25, 1.0), res("async", 1, 0.25, 0.375, 0.5)]
    rows = bench.summary_table(results)
    assert "0.375 ± 0.177" in rows[1]  # top20 after: mean of 0.5 and 0.25, sd 0.25/sqrt(2)
    assert rows[-1] == "ratio of mean s/step async/sync: 0.50"
    assert len(bench.run_table(results)) == 5
    _assert_png(bench.write_plot(tmp_path / "p.png", results, "t"))
    assert bench.title_of(results).startswith("task sum3, grpo, 10 steps x 32 prompts x 8 samples")
    assert bench.title_of(results).endswith("seeds 0 1")


def test_bench_merge_of_earlier_outputs(bench, tmp_path: Path, capsys):
    def res(arm: str, seed: int, steps: int) -> dict:
        return {"arm": arm, "seed": seed, "acc_before": 0.25, "acc_after": 0.5, "greedy_before": 0.3,
                "greedy_after": 0.4, "step_s": 1.0, "wall_s": 10.0, "kept_frac": 0.2, "updates": 1.0,
                "gain": {"mean": 0.25, "lo": 0.2, "hi": 0.3}, "curve": [(0, 0.25, 0.3), (steps, 0.5, 0.4)],
                "classes": {}, "settings": {"task": "sum3", "loss": "grpo", "steps": steps, "prompts_per_step": 32,
                                            "group_size": 8, "lr": 3e-4, "eval_prompts": 64}}

    (tmp_path / "s0.json").write_text(json.dumps({"results": [res("top20", 0, 10), res("full", 0, 10)]}))
    (tmp_path / "s1.json").write_text(json.dumps({"results": [res("top20", 1, 20), res("full", 1, 20)]}))
    got = bench.load_results([tmp_path / "s1.json", tmp_path / "s0.json"], ["full", "top20"], [0, 1])
    assert [(r["seed"], r["arm"]) for r in got] == [(0, "full"), (0, "top20"), (1, "full"), (1, "top20")]
    assert bench.load_results([tmp_path / "s0.json"], ["async"], [0]) == []
    plot = tmp_path / "merged.png"
    assert bench.main(["--merge", str(tmp_path / "s0.json"), str(tmp_path / "s1.json"), "--arms", "top20", "full",
                       "--seeds", "0", "1", "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "10/20 steps" in out and "+0.250 [+0.200, +0.300]" in out
    _assert_png(plot)
    assert bench.main(["--merge", str(tmp_path / "s0.json"), "--arms", "async", "--plot", str(plot)]) == 1


def test_demo_gain_line():
    sys.path.insert(0, str(REPO_ROOT))
    from clients.demo import gain_line

    g = {"mean": 0.1, "lo": 0.05, "hi": 0.15, "before": 0.25, "after": 0.35, "n_prompts": 256, "draws": 2000,
         "step_before": 0, "step_after": 60}
    line = gain_line(g)
    assert "+0.100" in line and "[+0.050, +0.150]" in line and "256 eval prompts" in line
    assert "no per-prompt" in gain_line(None)
