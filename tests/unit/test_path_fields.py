"""Every path field of a run (model, dataset, eval_dataset, run_dir) is refused naming that field, and a path the file
system cannot take (too long once the working directory is put in front, a symlink loop) is INVALID_ARGUMENT
(ValueError), wherever the checkout sits: issue 42 item 14, where a clone under /tmp (inside the tests' allowed
roots) turned `eval_dataset=['127.0.0.1:99999']` into "dataset: no such file" and a 100,000-character
eval_dataset into FAILED_PRECONDITION "File name too long".

The trainer's StartRun maps ValueError to INVALID_ARGUMENT and an OSError to FAILED_PRECONDITION
(trainer_service/server.py); these tests call preflight, the function it runs, with the working directory inside
the allowed roots, as in such a clone.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from forkrl.training.config import RunConfig
from forkrl.training.preflight import preflight
from forkrl.training.rules import RunRules

LONG = "x" * 100_000


@pytest.fixture
def inside(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> dict[str, Path]:
    """Roots (read: tmp_path, runs: tmp_path/runs) and a working directory inside them, about 1,000 bytes long."""
    cwd = tmp_path / "runs" / "/".join(["c" * 200] * 5)
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    return {"root": tmp_path, "runs": tmp_path / "runs", "cwd": cwd, "model": tiny_model_dir}


def _rules(w: dict[str, Path]) -> RunRules:
    return RunRules(runs_root=w["runs"].resolve(), read_roots=[w["root"].resolve(), w["model"].resolve()])


def _cfg(w: dict[str, Path], **kw) -> RunConfig:
    return RunConfig(**{"model": str(w["model"]), "num_steps": 1, "prompts_per_step": 2, "group_size": 2,
                        "eval_prompts": 0, **kw})


def test_an_eval_dataset_that_is_not_there_is_refused_naming_eval_dataset(inside) -> None:
    with pytest.raises(ValueError, match=r"^eval_dataset: no such file or folder '.*/127\.0\.0\.1:99999'"):
        preflight(_cfg(inside, eval_dataset=["127.0.0.1:99999"]), _rules(inside))
    with pytest.raises(ValueError, match=r"^eval_dataset: no such file or folder"):  # without the rules too
        preflight(_cfg(inside, eval_dataset=["127.0.0.1:99999"]))


def test_an_over_long_eval_dataset_is_refused_by_the_config_naming_it() -> None:
    with pytest.raises(ValidationError, match=r"eval_dataset must have at most 4096 bytes .* got 100,000 bytes"):
        RunConfig(eval_dataset=["ok.jsonl", LONG])
    with pytest.raises(ValidationError, match=r"eval_dataset must have at most .* 255 per name"):
        RunConfig(eval_dataset=["/tmp/" + "é" * 200])


@pytest.mark.parametrize("field", ["model", "dataset", "eval_dataset", "run_dir"])
def test_a_path_too_long_once_the_working_directory_is_put_in_front_is_invalid(inside, field: str) -> None:
    """4,015 bytes as given (RunConfig allows 4,096), over 5,000 once relative to the ~1,000-byte working dir."""
    rel = "/".join(["p" * 250] * 16)[:4015]
    value = [rel] if field == "eval_dataset" else rel
    cfg = _cfg(inside, **{field: value})
    with pytest.raises(ValueError, match=rf"^{field} 'p.* is too long for the file system: its real path .* has "
                                         r"[0-9,]+ bytes \(at most 4096\)") as err:
        preflight(cfg, _rules(inside))
    assert len(str(err.value)) < 1000


@pytest.mark.parametrize("field", ["model", "dataset", "eval_dataset", "run_dir"])
def test_a_symlink_loop_is_invalid_naming_the_field(inside, field: str) -> None:
    loop = inside["runs"] / "loop"
    os.symlink(loop, loop)
    value = str(loop / "x")
    cfg = _cfg(inside, **{field: [value] if field == "eval_dataset" else value})
    with pytest.raises(ValueError, match=rf"^{field} '.*loop/x' cannot be resolved"):
        preflight(cfg, _rules(inside))


def test_a_dataset_row_error_names_the_field(inside) -> None:
    bench = inside["root"] / "bench.jsonl"
    bench.write_text('{"prompt": "p", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match=r"^eval_dataset: .*bench\.jsonl:2: malformed JSON"):
        preflight(_cfg(inside, eval_dataset=[str(bench)]), _rules(inside))
    with pytest.raises(ValueError, match=r"^dataset: .*bench\.jsonl:2: malformed JSON"):
        preflight(_cfg(inside, dataset=str(bench)), _rules(inside))
