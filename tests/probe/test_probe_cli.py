"""`python -m forkrl.probe`: the seed script's flags and outputs on the tiny model (issue 14).

The seed's usage line runs with its flags as written (paths changed, fewer prompts); its record count is
one record per probed token x parameter x row: records == sum(tokens probed) x n_params x n_rows.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from markupsafe import escape
from safetensors.torch import load_file, save_file

from forkrl.probe.__main__ import main
from tests.service_fixtures import build_random_llama

pytestmark = pytest.mark.slow

SEED_FLAGS = [
    "--steps", "1,2", "--include-final", "--num-samples", "2", "--max-new-tokens", "2048",
    "--entropy-bins", "5", "--max-positions-per-group", "12", "--layer-indices", "0,14,27",
    "--row-spec", "start,mid,last",
]  # fmt: skip


@pytest.fixture(scope="module")
def root(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("probe_cli")
    try:
        src = Path(request.getfixturevalue("tiny_model_dir"))
    except pytest.FixtureLookupError:
        src = build_random_llama(tmp / "random_tiny", hidden_size=32, num_layers=2)
    root = tmp / "run" / "checkpoints"
    ignore = shutil.ignore_patterns("*.bin", "*.pt", "forkrl_build.json")
    for i, name in enumerate(["step_000001", "step_000002", "final"]):
        shutil.copytree(src, root / name, ignore=ignore)
        if i:  # a perturbed copy: a different checkpoint of the same architecture
            w = root / name / "model.safetensors"
            g = torch.Generator().manual_seed(i)
            t = load_file(w)
            save_file({k: v + 0.03 * i * v.std() * torch.randn(v.shape, generator=g)
                       if v.is_floating_point() and v.numel() > 1 else v for k, v in t.items()},
                      str(w), metadata={"format": "pt"})  # fmt: skip
    return root


def _read(out: Path) -> tuple[dict, list[dict], dict]:
    summary = json.loads((out / "summary.json").read_text())
    records = [json.loads(line) for line in (out / "token_probe_records.jsonl").read_text().splitlines()]
    manifest = json.loads((out / "manifest.json").read_text())
    return summary, records, manifest


def test_seed_usage_line_and_its_record_count(root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}+{c}=", "answer": str(a + b + c)}) + "\n"
                            for a in range(5) for b in range(5) for c in range(5)))  # fmt: skip
    monkeypatch.setenv("RL_DATASET_PATH", str(data))
    out = tmp_path / "out"
    argv = ["--checkpoint-root", str(root), *SEED_FLAGS, "--num-prompts", "4", "--bootstrap", "20",
            "--output-dir", str(out), "--no-progress", "--report"]  # fmt: skip
    assert main(argv) == 0
    summary, records, manifest = _read(out)
    assert summary["settings"]["dataset"] == str(data) and summary["settings"]["max_new_tokens"] == 2048
    assert [c["label"] for c in summary["checkpoints"]] == ["step_000001", "step_000002", "final"]
    assert "teacher forcing" in summary["caveat"] and manifest["caveat"] == summary["caveat"]
    assert any("layer 14" in w for w in summary["warnings"])  # the 2-layer model: 14 and 27 probe layer 1

    # the seed's grain: records == sum over checkpoints of tokens probed x parameters x rows
    params = {t["name"] for t in manifest["checkpoints"][0]["targets"]}
    assert params == {f"layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.k_proj", "mlp.down_proj")}
    n_rows = 3
    tokens = sum(c["n_selected"] for c in summary["checkpoints"])
    assert tokens > 0
    assert len(records) == summary["n_records"] == tokens * len(params) * n_rows
    for t in manifest["checkpoints"][0]["targets"]:
        assert all(len(rows) == 1 for rows in t["row_sets"].values())  # start/mid/last are single rows
    per_token: dict[tuple, set] = {}
    for x in records:
        per_token.setdefault((x["checkpoint"], x["trajectory"], x["position"]), set()).add((x["parameter"], x["row"]))
    assert len(per_token) == tokens
    assert all(len(s) == len(params) * n_rows for s in per_token.values())
    # the summary grain: checkpoint x bin x correctness x parameter x row, each with its intervals
    keys = {(r["checkpoint"], r["bin"], r["correct"], r["parameter"], r["row"]) for r in summary["results"]}
    assert len(keys) == len(summary["results"])
    assert all("ci95" in r and r["n_common"] == summary["effective_rank_common_n"][f"{r['target']}|{r['row']}"]
               for r in summary["results"])  # fmt: skip
    assert summary["bins"]["frozen_from"] == "step_000001"
    assert summary["entropy_pattern_overlap"]["overlap"]["step_000001"] == 1.0
    assert (out / "entropy_overlap.png").is_file() and "entropy_overlap.png" in manifest["files"]
    # --report: the job's page (forkrl/report), with the caveat and a chart per parameter x row set
    page = (out / "report.html").read_text()
    assert str(escape(summary["caveat"])) in page and page.count('<figure class="chart"') == len(params) * n_rows
    # each record carries its token's context: the text before it ends the prompt + response up to the token
    assert all(isinstance(x["context_before"], str) and isinstance(x["context_after"], str) for x in records)
    assert all(x["context_before"] for x in records)  # at least the prompt


def test_per_token_records_and_blocks(root: Path, tmp_path: Path):
    out = tmp_path / "out"
    argv = ["--checkpoint-root", str(root), "--steps", "2", "--num-prompts", "4", "--num-samples", "2",
            "--max-positions-per-group", "3", "--entropy-bins", "2", "--modules", "k_proj,lm_head",
            "--layers", "-1", "--row-specs", "start,last", "--row-mode", "block", "--record-grain", "token",
            "--freeze-bins-from", "none", "--bootstrap", "0", "--output-dir", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    summary, records, manifest = _read(out)
    assert len(records) == summary["n_records"] == summary["checkpoints"][0]["n_selected"] > 0
    assert all(len(x["grad_norms"]) == 2 * 2 for x in records)
    rows = {t["name"]: t["row_sets"] for t in manifest["checkpoints"][0]["targets"]}
    assert rows["lm_head"]["start"] == list(range(len(rows["lm_head"]["start"]))) and len(rows["lm_head"]["start"]) > 1
    head = rows["layers.1.self_attn.k_proj"]["last"]  # one whole KV head in block mode
    assert head == list(range(head[0], head[0] + len(head))) and len(head) > 1
    assert summary["bins"]["frozen_from"] is None and all(r["ci95"] == {} for r in summary["results"])


def test_bad_flags_and_inputs_exit_2(root: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit) as exc:
        main(["--checkpoint-root", str(root), "--steps", "1", "--num-samples", "0"])
    assert exc.value.code == 2 and "--num-samples" in capsys.readouterr().err
    assert main(["--checkpoint-root", str(root), "--steps", "1,40", "--output-dir", str(tmp_path / "o")]) == 2
    assert "[40]" in capsys.readouterr().err
    assert main(["--checkpoint-root", str(root), "--steps", "1", "--freeze-bins-from", "7"]) == 2
    assert "freeze_bins_from" in capsys.readouterr().err


def test_help_lists_the_seed_flags_and_the_caveat():
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    r = subprocess.run([sys.executable, "-m", "forkrl.probe", "--help"], capture_output=True, text=True, env=env,
                       timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    for flag in ("--checkpoint-root", "--steps", "--include-final", "--num-prompts", "--num-samples",
                 "--max-new-tokens", "--entropy-bins", "--max-positions-per-group", "--layer-indices",
                 "--row-spec", "--output-dir", "--dataset", "--row-mode", "--record-grain", "--freeze-bins-from",
                 "--bootstrap"):  # fmt: skip
        assert flag in r.stdout, flag
    assert "teacher-forced" in r.stdout
