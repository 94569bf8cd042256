"""forkrl.report: the eval sample the trainer records (teacher-forced entropy, kept flags, counts) and the pages
rendered from a run dir and a probe job dir (what they show, what they escape, that they reference nothing)."""

from __future__ import annotations

import json
import math
import re
import xml.etree.ElementTree as ET
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from forkrl.data.tasks import make_split
from forkrl.report.data import kept_ranking, rank_moves, read_run
from forkrl.report.record import (
    HIST_EDGES,
    MAX_SHOWN_TOKENS,
    SAMPLED_RESPONSES,
    SHOWN_RESPONSES,
    EvalRecorder,
    entropy_histogram,
    samples_file,
    teacher_forced,
)
from forkrl.rl.batch import build_batch
from forkrl.rl.entropy import causal_lm_logprobs_and_entropy
from tests.numerics import ATTN_FP32_RTOL, FP32_EPS

VOCAB = 23
SVG_NS = "{http://www.w3.org/2000/svg}"


def _model(seed: int = 0, dtype: torch.dtype = torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(dtype)


def test_entropy_histogram_bins_exact_edges_and_the_tails() -> None:
    counts, below = entropy_histogram([0.0, 5e-5, HIST_EDGES[0], HIST_EDGES[1], 0.5, HIST_EDGES[-1], 1e6])
    assert below == 2  # 0 and 5e-5 lie under the first edge (1e-4)
    assert len(counts) == len(HIST_EDGES) - 1 and sum(counts) == 5
    assert counts[0] == 1 and counts[1] == 1  # an edge opens its bin
    assert counts[-1] == 2  # the last edge and anything past it
    assert counts[int(math.floor(4 * math.log10(0.5))) + 16] == 1  # 0.5 nats: 4 bins per decade from 1e-4


def test_teacher_forced_equals_the_train_steps_padded_forward() -> None:
    """The report's one-sequence pass (logits of the completion only) gives the train step's logp and entropy:
    the same tokens through build_batch's right-padded batch and the public entropy pass."""
    model = _model()
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(3, VOCAB, (int(n),), generator=g).tolist(), torch.randint(3, VOCAB, (int(m),),
             generator=g).tolist()) for n, m in ((3, 5), (6, 1), (2, 9))] + [([4, 5], [])]
    T = 0.7
    got = teacher_forced(model, seqs, T, torch.device("cpu"))
    assert [len(lp) for lp, _ in got] == [len(c) for _, c in seqs]
    real = [s for s in seqs if s[1]]
    batch = build_batch([p for p, _ in real], [c for _, c in real], [[0.0] * len(c) for _, c in real], pad_id=0)
    with torch.no_grad():
        logp, ent = causal_lm_logprobs_and_entropy(model, batch.input_ids, batch.attention_mask, batch.response_mask,
                                                   temperature=T)
    for i, (lp, h) in enumerate(g for g in got if g[0]):
        ref_lp, ref_h = logp[i][batch.response_mask[i]].tolist(), ent[i][batch.response_mask[i]].tolist()
        for a, b in zip(lp + h, ref_lp + ref_h, strict=True):  # float64 model: attention's fp32 softmax, fp32 out
            assert abs(a - b) <= ATTN_FP32_RTOL * (1 + abs(b)) + FP32_EPS * abs(b), (i, a, b)
    assert model.training  # put back as it was


def _traj(prompt: list[int], completion: list[int], text: str) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=prompt, completion_token_ids=completion, completion_text=text)


class _Tok:
    """Token ids of the digits, operators and EOS of countdown completions (id 1 = EOS)."""

    chars = "0123456789+-*=,"

    def ids(self, text: str) -> list[int]:
        return [3 + self.chars.index(c) for c in text] + [1]

    def text(self, i: int) -> str | None:
        return None if i == 1 else self.chars[i - 3]


def test_recorder_writes_kept_flags_counts_and_classes(tmp_path: Path) -> None:
    """record(): the top-k of each response by its teacher-forced entropy, k = max(1, ceil(rho n)); the shown
    responses token by token, every sampled one in the summary's histogram and counts; countdown classes."""
    tok = _Tok()
    model = _model(dtype=torch.float32)
    problems = make_split("countdown", "eval", SAMPLED_RESPONSES + 3, seed=0)
    sampled = []
    for i, p in enumerate(problems):
        text = p.meta["completion"] if i % 2 else p.meta["completion"][:-1] + "9"  # some right, some wrong
        sampled.append(([_traj([3, 4, 5], tok.ids(text), text)], [1.0 if i % 2 else 0.0]))
    sampled[1] = ([], [])  # a prompt without samples is skipped
    policy = SimpleNamespace(model=model, device=torch.device("cpu"), token_text=tok.text)
    cfg = SimpleNamespace(entropy_top_frac=0.2, temperature=1.0, reward="countdown", prompt_format="raw")
    rec = EvalRecorder(tmp_path, cfg, policy)
    out = rec.record(7, problems, sampled)
    assert out["time_eval_samples_s"] >= 0
    lines = [json.loads(s) for s in samples_file(tmp_path, 7).read_text().splitlines()]
    summary, responses = lines[0], lines[1:]
    assert summary["kind"] == "summary" and summary["step"] == 7 and summary["n_responses"] == SAMPLED_RESPONSES
    assert len(responses) == SHOWN_RESPONSES and [r["prompt_index"] for r in responses] == [0, 2, 3, 4]
    sampled_lengths = [len(s[0][0].completion_token_ids) for s in sampled if s[0]][:SAMPLED_RESPONSES]
    assert summary["n_tokens"] == sum(sampled_lengths) == sum(summary["hist_counts"]) + summary["hist_below"]
    assert summary["n_kept"] == sum(max(1, math.ceil(0.2 * n)) for n in sampled_lengths)
    assert sum(n for _, n, _ in summary["kept_tokens"]) == summary["n_kept"]
    assert sum(summary["class_kept"].values()) == summary["n_kept"]
    assert sum(summary["class_tokens"].values()) == summary["n_tokens"]
    for r in responses:
        n = r["n_tokens"]
        assert len(r["tokens"]) == len(r["entropy"]) == len(r["logp"]) == len(r["kept"]) == len(r["classes"]) == n
        assert sum(r["kept"]) == max(1, math.ceil(0.2 * n))
        kept_h = [h for h, k in zip(r["entropy"], r["kept"], strict=True) if k]
        other_h = [h for h, k in zip(r["entropy"], r["kept"], strict=True) if not k]
        assert min(kept_h) >= max(other_h)  # the top of this response by entropy
        assert r["eos"][-1] and r["tokens"][-1] == "" and r["classes"][-1] == "eos"
        assert r["classes"][0] == "choice" and all(lp <= 0 for lp in r["logp"]) and min(r["entropy"]) >= 0
        assert r["given"] == ("".join(r["tokens"]).rsplit("=", 1)[-1])
        assert r["reward"] == float(r["prompt_index"] % 2)
    # the page's kept tokens are counted by text, with the class each was kept as
    assert {c for _, _, by in summary["kept_tokens"] for c in by} <= {"choice", "computed", "separator", "eos",
                                                                      "other"}
    assert rec.record(8, problems[:1], [([], [])]) == {}  # nothing sampled: nothing written
    assert not samples_file(tmp_path, 8).exists()


def test_a_long_response_is_cut_on_the_page_but_counted_whole(tmp_path: Path) -> None:
    n = MAX_SHOWN_TOKENS + 20
    problem = SimpleNamespace(prompt="x", answer="1", meta={})
    traj = _traj([3, 4], [3 + (i % 15) for i in range(n)], "1")
    policy = SimpleNamespace(model=_model(dtype=torch.float32), device=torch.device("cpu"),
                             token_text=_Tok().text)
    cfg = SimpleNamespace(entropy_top_frac=0.5, temperature=1.0, reward="exact_match", prompt_format="raw")
    EvalRecorder(tmp_path, cfg, policy).record(1, [problem], [([traj], [None])])
    summary, r = (json.loads(s) for s in samples_file(tmp_path, 1).read_text().splitlines())
    assert r["truncated"] and r["n_tokens"] == n and len(r["tokens"]) == len(r["kept"]) == MAX_SHOWN_TOKENS
    assert summary["n_kept"] == math.ceil(0.5 * n) and r["classes"] is None and r["reward"] is None
    assert summary["class_tokens"] == {}  # a dataset's problem: no classes


def _summary(step: int, kept: list[tuple[str, int, dict]], seen: dict[str, int]) -> dict:
    return {"kind": "summary", "step": step, "kept_tokens": [list(k) for k in kept], "all_tokens": seen,
            "n_kept": sum(n for _, n, _ in kept), "n_tokens": sum(seen.values()), "n_responses": 2,
            "hist_edges": HIST_EDGES, "hist_counts": [0] * 10 + [3, 4] + [0] * 12, "hist_below": 1,
            "top_frac": 0.2, "class_tokens": {}, "class_kept": {}}


def test_kept_ranking_and_its_moves() -> None:
    a = _summary(0, [("+", 5, {"choice": 5}), ("7", 3, {"choice": 2, "computed": 1}), ("=", 1, {"separator": 1})],
                 {"+": 9, "7": 6, "=": 20})
    b = _summary(9, [("7", 8, {"choice": 8}), ("+", 4, {"choice": 4}), ("*", 2, {"choice": 2})],
                 {"+": 9, "7": 10, "*": 2})
    rows = kept_ranking([a, b])
    assert [(r.rank, r.text, r.kept, r.seen) for r in rows] == [(1, "7", 11, 16), (2, "+", 9, 18), (3, "*", 2, 2),
                                                               (4, "=", 1, 20)]
    assert rows[0].classes == {"choice": 10, "computed": 1} and rows[0].main_class == "choice"
    assert rows[1].rate == 0.5
    moves = {m["text"]: m for m in rank_moves(a, b)}
    assert moves["7"]["rank"] == 1 and moves["7"]["before"] == 2 and moves["7"]["move"] == 1
    assert moves["+"]["move"] == -1 and moves["*"]["before"] is None  # new in the last eval's list
    assert moves["="]["dropped"] and moves["="]["rank"] is None and moves["="]["count"] == 0


def _write_run(run_dir: Path, steps: int = 3, evals: tuple[int, ...] = (0, 3)) -> None:
    """A run dir as the trainer writes it: config, train and eval lines, and one samples file per eval."""
    run_dir.mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"task": "countdown", "loss": "grpo", "entropy_top_frac": 0.2,
                                                     "num_steps": steps, "temperature": 1.0}))
    lines = [{"step": 0, "kind": "eval", "eval_accuracy": 0.25, "eval_greedy_accuracy": 0.5, "time_eval_s": 1.0}]
    for s in range(1, steps + 1):
        lines.append({"step": s, "kind": "train", "reward_mean": 0.1 * s, "accuracy": 0.1 * s, "entropy_mean": 0.3,
                      "entropy_p50": 0.01, "entropy_p90": 0.8, "kept_frac": 0.2, "clip_frac_low": 0.0,
                      "clip_frac_high": 0.01 * s, "ratio_mean": 1.0, "approx_kl": 1e-4 * s, "time_step_s": 1.5,
                      "time_generate_s": 0.5, "time_train_s": 0.7, "kept_share_choice": 0.9, "all_share_choice": 0.4,
                      "kept_rate_choice": 0.45, "kept_share_computed": 0.1, "all_share_computed": 0.6,
                      "kept_rate_computed": 0.03})
    lines.append({"step": steps, "kind": "eval", "eval_accuracy": 0.5, "eval_greedy_accuracy": 0.75})
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    for step in evals:
        resp = {"kind": "response", "step": step, "prompt_index": 0, "prompt": "3 7 4->25:", "answer": "25",
                "given": "<b>25</b>", "reward": 1.0, "tokens": ["7", "*", "<script>alert(1)</script>", "\n", ""],
                "eos": [False, False, False, False, True], "entropy": [1.2, 0.9, 0.001, 0.0, 0.02],
                "logp": [-0.7, -0.4, -1e-4, 0.0, -0.01], "kept": [True, True, False, False, False],
                "classes": ["choice", "choice", "other", "other", "eos"], "n_tokens": 5, "truncated": False}
        summary = _summary(step, [("7", 2 + step, {"choice": 2 + step}), ("*", 2, {"choice": 2})], {"7": 9, "*": 3})
        path = samples_file(run_dir, step)
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(summary) + "\n" + json.dumps(resp) + "\n" + json.dumps({**resp, "prompt_index": 1})
                        + "\n")


def _svgs(html: str) -> list[ET.Element]:
    return [ET.fromstring(m) for m in re.findall(r"<svg.*?</svg>", html, flags=re.S)]


def _points(svgs: list[ET.Element], gid: str) -> int:
    """Markers (one <use> per data point) in the SVG group with this id; -1 when there is no such group."""
    for svg in svgs:
        for g in svg.iter(f"{SVG_NS}g"):
            if g.get("id") == gid:
                return sum(1 for _ in g.iter(f"{SVG_NS}use"))
    return -1


@pytest.mark.slow  # renders a whole page (matplotlib)
def test_run_page_shows_the_recorded_tokens_escaped_and_the_curves(tmp_path: Path) -> None:
    from forkrl.report.run_page import render_run_report

    run_dir = tmp_path / "run"
    _write_run(run_dir)
    html = render_run_report(run_dir)
    # every kept flag of the recorded responses is one marked token; nothing of a model's text becomes markup
    assert len(re.findall(r'<span class="tok kept', html)) == 2 * 2 * 2
    assert "<script" not in html and "&lt;script&gt;alert(1)&lt;/script&gt;" in html
    assert "&lt;b&gt;25&lt;/b&gt;" in html
    assert 'data-entropy="1.2"' in html and "entropy 1.2000 nats · log-prob -0.7000" in html
    # self-contained: nothing to fetch (anchors and the SVG's own references only), and a policy saying so
    assert not re.search(r"""\s(src|srcset)=""", html) and "<link" not in html
    assert set(re.findall(r'href="([^"#][^"]*)"', html)) == set()
    assert "default-src 'none'" in html
    # the charts hold their data points
    svgs = _svgs(html)
    assert _points(svgs, "reward--reward_mean") == 3 and _points(svgs, "reward--eval_accuracy") == 2
    assert _points(svgs, "clip--clip_frac_high") == 3 and _points(svgs, "time--time_train_s") == 3
    assert _points(svgs, "class_shares--kept_share_choice") == 3
    assert _points(svgs, "entropy_hist--step_0") == 2 and _points(svgs, "entropy_hist--step_3") == 2
    ids = [e.get("id") for svg in svgs for e in svg.iter() if e.get("id")]
    assert len(ids) == len(set(ids)), "two charts share an SVG id"
    # what the mask keeps: the class table's sentence
    assert re.search(r"choice</b> tokens are\s+<b>90.0%</b> of the kept tokens but 40.0% of all tokens", html)
    run = read_run(run_dir)
    assert [s.step for s in run.samples] == [0, 3] and run.samples[-1].kept_shown == 4


def test_run_page_of_a_run_without_samples_or_classes(tmp_path: Path) -> None:
    from forkrl.report.run_page import write_run_report

    run_dir = tmp_path / "bare"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "kind": "train", "reward_mean": 0.5}) + "\n")
    path = write_run_report(run_dir)
    html = path.read_text()
    assert path == run_dir / "report.html" and "tok kept" not in html and 'id="mask"' not in html
    assert _points(_svgs(html), "reward--reward_mean") == 1
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl"):
        read_run(tmp_path)


def _write_probe_job(job: Path) -> dict:
    job.mkdir()
    results = []
    for ckpt in ("step_000001", "final"):
        for b in range(3):
            for correct in (True, False):
                med = 10.0 ** (b - 4) * (1.5 if correct else 1.0)
                results.append({"checkpoint": ckpt, "bin": b, "correct": correct, "target": "layers.1.mlp.down_proj",
                                "row_set": "random:4", "n": 4, "grad_norm": {"median": med},
                                "ci95": {"grad_norm.median": [med / 2, med * 2]} if b != 1 else {}})
    summary = {"caveat": "This probes per-token log-prob gradients under teacher forcing.",
               "checkpoints": [{"label": c, "step": s, "n_trajectories": 8, "accuracy": 0.5, "mean_entropy": 0.3,
                                "frac_entropy_below_1e-2": 0.4, "n_selected": 24, "bin_edges": [0.01, 0.5]}
                               for c, s in (("step_000001", 1), ("final", None))],
               "results": results, "entropy_pattern_overlap": {"reference": "step_000001", "top_frac": 0.2,
                                                               "n_tokens": 40, "overlap": {"step_000001": 1.0,
                                                                                           "final": 0.875}},
               "settings": {"entropy_bins": 3, "bootstrap": 20, "task": "countdown", "num_prompts": 2,
                            "num_samples": 4, "temperature": 1.0, "max_positions_per_group": 4,
                            "layer_indices": [-1], "row_spec": ["random:4"]}}
    (job / "summary.json").write_text(json.dumps(summary))
    recs = [{"checkpoint": "final", "trajectory": t, "response_position": 2, "token_text": "<i>", "entropy": 0.7,
             "logp": -0.5, "bin": 2, "correct": t % 2 == 0, "context_before": "3 7 4->25:7", "context_after": "3=21",
             "parameter": p} for t in range(10) for p in ("a", "b")]
    (job / "token_probe_records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return summary


def test_probe_page_shows_cells_intervals_overlap_caveat_and_examples(tmp_path: Path) -> None:
    from forkrl.report.probe_page import EXAMPLES_PER_BIN, PLAIN_CAVEAT, examples, render_probe_report

    job = tmp_path / "job"
    summary = _write_probe_job(job)
    html = render_probe_report(job)
    assert summary["caveat"] in html and PLAIN_CAVEAT.split(":")[0] in html
    svgs = _svgs(html)
    for ckpt in ("step_000001", "final"):
        for which in ("correct", "incorrect"):
            assert _points(svgs, f"grad-0--{ckpt}--{which}") == 3
    assert "[5e-05, 0.0002]" in html  # bin 0, incorrect: median 1e-4 and its interval
    assert "87.5%" in html  # the overlap of `final`
    ex = examples(job / "token_probe_records.jsonl")
    picked = ex["final"][2]
    assert len(picked) == EXAMPLES_PER_BIN and sum(r["correct"] for r in picked) == EXAMPLES_PER_BIN // 2
    assert len({r["trajectory"] for r in picked}) == EXAMPLES_PER_BIN  # one per probed token, not per parameter
    assert "3 7 4-&gt;25:7<span class=\"tok\"" in html and "&lt;i&gt;" in html


@pytest.mark.slow  # renders a whole page (matplotlib)
def test_report_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from forkrl.report.__main__ import main

    run_dir = tmp_path / "run"
    _write_run(run_dir)
    assert main([str(run_dir), "--out", str(tmp_path / "r.html")]) == 0
    assert (tmp_path / "r.html").read_text().startswith("<!DOCTYPE html>")
    _write_probe_job(tmp_path / "job")
    assert main([str(tmp_path / "job")]) == 0 and (tmp_path / "job" / "report.html").is_file()
    assert main([str(tmp_path)]) == 2
    assert "neither metrics.jsonl" in capsys.readouterr().err


def test_the_page_spreads_its_eval_steps_and_a_resume_drops_later_samples(tmp_path: Path) -> None:
    from forkrl.report.run_page import spread

    assert spread(3, 12) == [0, 1, 2]
    picked = spread(100, 12)
    assert len(picked) == 12 and picked[0] == 0 and picked[-1] == 99 and picked == sorted(set(picked))
    for step in (0, 10, 20, 30):
        samples_file(tmp_path, step).parent.mkdir(exist_ok=True)
        samples_file(tmp_path, step).write_text("{}\n")
    policy = SimpleNamespace(resumed=True, start_step=10)
    EvalRecorder(tmp_path, SimpleNamespace(), policy)  # a resume from step 10 runs steps 11.. (and their evals) again
    assert sorted(p.name for p in (tmp_path / "eval_samples").iterdir()) == ["step_000000.jsonl", "step_000010.jsonl"]


def test_without_the_mask_the_page_says_so(tmp_path: Path) -> None:
    from forkrl.report.run_page import render_run_report

    run_dir = tmp_path / "run"
    _write_run(run_dir, evals=())
    cfg = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**cfg, "entropy_top_frac": None}))
    html = render_run_report(run_dir)
    assert "The mask is off" in html and "of the kept tokens but" not in html and 'id="class-table"' in html
