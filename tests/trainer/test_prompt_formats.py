"""A real user's run through the real services: the committed tiny model with a chat template added to a test copy
of it, trained with --prompt-format chat and a system prompt, evaluated in training on a benchmark file
(--eval-dataset). The rollout service samples from exactly the token ids the trainer formatted (it returns them
unchanged, it counts exactly their tokens), and the trainer's log-probs are computed on those ids (their gap to
the engine's stays within float32 rounding, which a different prompt would exceed by orders of magnitude).
A model without a chat template asked for chat is refused at StartRun, before any work."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from forkrl.data.datasets import load_problems
from forkrl.data.order import DataOrder
from forkrl.data.tasks import make_split
from forkrl.remote.rollout import RolloutClient
from forkrl.training.config import RunConfig, to_proto
from forkrl.training.loop import TRAIN_POOL
from forkrl.wire.trainer.v1 import trainer_pb2
from tests.trainer.helpers import metric_lines, run_to_end, trainer_rollout_logp_ceiling, trainer_stub

pytestmark = pytest.mark.slow

# in the tiny tokenizer's alphabet (printable ASCII); its BOS written as text, as real templates do
CHAT = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")
SYSTEM = "Be exact."


@pytest.fixture(scope="module")
def chat_model(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A test copy of the committed model whose tokenizer has a chat template (the weights are the same)."""
    import shutil

    from transformers import AutoTokenizer

    out = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("chat") / "model")
    tok = AutoTokenizer.from_pretrained(out)
    tok.chat_template = CHAT
    tok.save_pretrained(out)
    return out


def _chat_ids(tok, prompt: str) -> list[int]:
    """The ids of the chat format computed here, from the template itself (not through forkrl's encoder)."""
    text = tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == f"<s>[system]{SYSTEM}[user]{prompt}[assistant]"
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_a_chat_templated_run_samples_and_trains_on_the_same_token_ids(rollout_address, trainer, chat_model,
                                                                       tmp_path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_model)
    # (1) the rollout service gives back exactly the ids it was sent (what the trainer trains on)
    prompts = [p.prompt for p in make_split("countdown", "eval", 3, seed=2)]
    sent = [_chat_ids(tok, p) for p in prompts]
    with RolloutClient(rollout_address, timeout_s=120) as c:
        got = {t.prompt_index: list(t.prompt_token_ids) for t in c.generate(sent, n=1, max_new_tokens=4, seed=1)}
        before = c.info().counters.prompt_tokens
    assert [got[i] for i in range(3)] == sent

    # (2) a run with the chat format and a benchmark file as its in-training eval
    bench = tmp_path / "cd_bench.jsonl"
    evals = make_split("countdown", "eval", 6, seed=5)
    bench.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in evals))
    run_dir = tmp_path / "chat_run"
    cfg = RunConfig(model=str(chat_model), rollout_addresses=[rollout_address], run_dir=str(run_dir), seed=3,
                    num_steps=1, prompts_per_step=8, group_size=4, prompt_format="chat", system_prompt=SYSTEM,
                    eval_dataset=[str(bench)], eval_prompts=4, entropy_top_frac=0.2)
    _, _, run = run_to_end(trainer[0], cfg)
    assert run.state == trainer_pb2.RUN_STATE_SUCCEEDED, run.error
    with RolloutClient(rollout_address, timeout_s=120) as c:
        after = c.info().counters.prompt_tokens
    # every prompt token the service received: step 1's 8 prompts x 4 samples, and two evaluations (before and
    # after) of the benchmark's first 4 problems x (4 samples at T + 1 greedy), all in the chat format
    step1 = DataOrder(load_problems("countdown", None, "train", TRAIN_POOL, cfg.seed), cfg.seed).take(8)
    expected = 4 * sum(len(_chat_ids(tok, p.prompt)) for p in step1) \
        + 2 * 5 * sum(len(_chat_ids(tok, p.prompt)) for p in evals[:4])
    assert after - before == expected
    (m,) = metric_lines(run_dir)
    assert m["logp_delta_max"] <= trainer_rollout_logp_ceiling(chat_model)  # logp on the ids the engine sampled
    ev = metric_lines(run_dir, "eval")
    assert [e["step"] for e in ev] == [0, 1]
    for e in ev:  # one benchmark: its accuracy is the eval's, a count over 4 prompts x 4 samples
        assert e["eval_accuracy_cd_bench"] == e["eval_accuracy"] and (e["eval_accuracy"] * 16).is_integer()
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["prompt_format"], saved["system_prompt"]) == ("chat", SYSTEM)


def test_a_chat_format_on_a_model_without_a_chat_template_is_refused_at_start(rollout_address, trainer,
                                                                             tiny_model_dir) -> None:
    def refused(**kw) -> str:
        cfg = RunConfig(model=str(tiny_model_dir), rollout_addresses=[rollout_address], **kw)
        with trainer_stub(trainer[0]) as stub, pytest.raises(grpc.RpcError) as err:
            stub.StartRun(trainer_pb2.StartRunRequest(config=to_proto(cfg)), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return err.value.details()

    msg = refused(prompt_format="chat")
    assert "prompt_format 'chat' applies the tokenizer's chat template" in msg and "no chat template" in msg
    # a template format with a built-in task's reward: the reward would not read the answer where it is asked for
    assert "asks for the answer on a last 'Answer:' line, and reward 'countdown'" in refused(prompt_format="dapo")


def test_the_eval_samples_through_a_running_rollout_service(rollout_address, tiny_model_dir, tmp_path) -> None:
    """python -m forkrl.eval --sampler rollout: the service serves the evaluated checkpoint (pushed here first);
    every problem gets its n samples, graded as the countdown verifier grades them."""
    from safetensors.torch import load_file

    from forkrl.data.countdown import check_solution, parse_prompt
    from forkrl.eval import EvalParams, run_eval

    with RolloutClient(rollout_address, timeout_s=120) as c:
        c.update_weights(load_file(str(tiny_model_dir / "model.safetensors")), c.info().version + 1)
    problems = make_split("countdown", "eval", 5, seed=6)
    bench = tmp_path / "cd.jsonl"
    bench.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    summary = run_eval(EvalParams(checkpoints=[str(tiny_model_dir)], benchmarks=[str(bench)], reward="countdown",
                                  num_samples=3, pass_k=[1, 3], max_new_tokens=16, sampler="rollout",
                                  rollout_address=rollout_address), tmp_path / "out", progress=lambda msg: None)
    ((label, row),) = summary["results"]["cd"].items()
    samples = [json.loads(s) for s in (tmp_path / "out" / "samples.jsonl").read_text().splitlines()]
    assert sorted((s["index"], s["sample"]) for s in samples) == [(i, g) for i in range(5) for g in range(3)]
    counts = [0] * 5
    for s in samples:
        counts[s["index"]] += check_solution(s["text"], *parse_prompt(problems[s["index"]].prompt)) == "correct"
    assert row["avg@3"] == pytest.approx(sum(c / 3 for c in counts) / 5, abs=1e-12)
    assert row["pass@3"] == pytest.approx(sum(c > 0 for c in counts) / 5, abs=1e-12)  # pass@n: any correct
