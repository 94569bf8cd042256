"""The embedded tiny model: an HF directory that transformers and vLLM load as is, warm-started into the
target accuracy band, with vLLM and HF per-token logprobs in agreement, built deterministically and cached.

The determinism and cache tests build the default model sizes with SFT cut to 30 steps: the same code
path as the full build (`_train`), which is too slow (~1.5-2 min on 2 cores) to run three more times.
"""

import gc
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from forkrl.data.tasks import extract_answer, get_task, make_split
from forkrl.models.tiny import (
    BUILD_RECORD,
    MODEL_FILE,
    BuildConfig,
    build_tiny_model,
    default_model_dir,
    evaluate_accuracy,
    load_model_and_tokenizer,
    read_build_record,
    sha256_file,
)
from forkrl.runtime import rpc_dir
from tests.numerics import logprob_parity

REPO = Path(__file__).resolve().parents[2]
# measured: in-process engine starts in ~3-15 s; these are what it needs on a CPU machine
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_CACHE_ROOT": str(REPO / ".cache" / "vllm"),
    "VLLM_RPC_BASE_PATH": str(rpc_dir(REPO / ".cache")),  # a short folder when the checkout's path is long
    "TORCHINDUCTOR_CACHE_DIR": str(REPO / ".cache" / "inductor"),
    "VLLM_NO_USAGE_STATS": "1",
}
# the written-out format of each task's completions (the chain of steps, right or wrong)
FORMAT_RE = {"sum3": re.compile(r"\d+\+\d+=\d+"),
             "countdown": re.compile(r"\d+[+\-*]\d+=\d+(,\d+[+\-*]\d+=\d+)*")}
SHORT = BuildConfig(max_steps=30, eval_every=10, eval_problems=64, final_eval_problems=64)


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_model_and_tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def hf64(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def eval_problems(tiny_model_dir):
    task = read_build_record(tiny_model_dir)["config"]["task"]  # the task the model was warm-started on
    return make_split(task, "eval", 1024, seed=2)  # not the sets the builder measured on


# ---- the directory -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_directory_is_a_plain_hf_checkpoint(tiny_model_dir, hf):
    model, tokenizer = hf
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert config["vocab_size"] == len(tokenizer) == 99
    assert config["tie_word_embeddings"] is False
    assert json.loads((tiny_model_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    record = read_build_record(tiny_model_dir)
    assert record is not None and record["sha256"] == sha256_file(tiny_model_dir / MODEL_FILE)
    assert record["params"] == sum(p.numel() for p in model.parameters())
    # no weight left at its random init because of a name mismatch
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(tiny_model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.slow
def test_tokenizer_is_one_char_per_token_with_bos(hf):
    _, tokenizer = hf
    text = "47 ab+1=  x"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id == 1 and len(ids) == len(text) + 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == text  # spaces survive
    assert tokenizer.eos_token_id == 2 and tokenizer.pad_token_id == 0
    assert tokenizer("é")["input_ids"] == [1, tokenizer.unk_token_id]


# ---- the warm start ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_completions_follow_the_chain_format(hf, eval_problems):
    # SFT teaches the format long before the answers (the builder stops at the first eval that reaches
    # the accuracy target, hundreds of steps after the loss of the format tokens is ~0), so any build
    # writes its task's format nearly always ("a+b=c+d=e", "a*b=c,c+d=e"), right or wrong.
    model, tokenizer = hf
    for temperature in (0.0, 1.0):
        result = evaluate_accuracy(model, eval_problems[:256], tokenizer=tokenizer, temperature=temperature)
        texts = [c for cs in result.completions for c in cs]
        assert sum(extract_answer(t) is not None for t in texts) >= 0.95 * len(texts)
        chain = FORMAT_RE[eval_problems[0].meta["task"]]
        assert sum(bool(chain.fullmatch(t)) for t in texts) >= 0.9 * len(texts)


def _five_sigma(p: float, *ns: int) -> float:
    """5 standard deviations of a difference of independent accuracy estimates over ns problems each."""
    return 5 * math.sqrt(max(p * (1 - p), 1e-3) * sum(1 / n for n in ns))


@pytest.mark.slow
def test_warm_start_accuracy_is_in_the_band(tiny_model_dir, hf, eval_problems):
    """Bands from the build record, not from one build: the builder stopped because its sampled accuracy
    reached the target; docs/embedded-default.md's documented band is 20-50%; and accuracy measured here on other
    problems agrees with the record within sampling error. One build's numbers: bench/bench_tiny_model.py."""
    model, tokenizer = hf
    record = read_build_record(tiny_model_dir)
    acc = record["accuracy"]
    assert record["reached_target"] and acc["stop_eval_t1"] >= record["config"]["target_accuracy"]
    assert 0.20 <= acc["t1"] <= 0.50
    sampled = evaluate_accuracy(model, eval_problems, tokenizer=tokenizer, temperature=1.0, seed=123)
    greedy = evaluate_accuracy(model, eval_problems, tokenizer=tokenizer, temperature=0.0)
    n_rec = acc["final_eval_problems"]
    assert abs(sampled.accuracy - acc["t1"]) <= _five_sigma(acc["t1"], n_rec, len(eval_problems))
    assert abs(greedy.accuracy - acc["greedy"]) <= _five_sigma(acc["greedy"], n_rec, len(eval_problems))
    # RL needs groups with mixed rewards. Not implied by the mean accuracy (a model always right on a
    # quarter of the problems and never on the rest has none), but every SFT build samples with spread at
    # T = 1: a quarter of the groups mixed is a lower bound with a wide margin (the bench prints the counts).
    grouped = evaluate_accuracy(model, eval_problems[:256], tokenizer=tokenizer, n_samples=8, seed=7)
    mixed = sum(0 < f < 1 for f in grouped.per_problem)
    assert mixed >= 64, mixed
    # the path form loads the directory itself
    assert evaluate_accuracy(tiny_model_dir, eval_problems[:64], temperature=0.0).accuracy == pytest.approx(
        evaluate_accuracy(model, eval_problems[:64], tokenizer=tokenizer, temperature=0.0).accuracy
    )


# ---- vLLM --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_engine(tiny_model_dir):
    with pytest.MonkeyPatch.context() as mp:  # the environment is restored after the module
        for key, value in VLLM_ENV.items():
            if key not in os.environ:
                mp.setenv(key, value)
        Path(os.environ["VLLM_RPC_BASE_PATH"]).mkdir(parents=True, exist_ok=True)
        from vllm import LLM

        llm = LLM(
            model=str(tiny_model_dir),
            dtype="float32",
            enforce_eager=True,
            logprobs_mode="processed_logprobs",  # log-softmax(logits / T): what the trainer's ratio uses
            max_model_len=64,
            seed=0,
        )
        try:
            yield llm
        finally:
            del llm
            gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_logprobs_match_hf(vllm_engine, hf, hf64, eval_problems, temperature):
    from vllm import SamplingParams

    model, tokenizer = hf
    problems = eval_problems[:32]
    max_tokens = get_task(problems[0].meta["task"]).max_new_tokens
    params = [
        SamplingParams(temperature=temperature, top_p=1.0, top_k=-1, n=4, max_tokens=max_tokens, logprobs=0, seed=i)
        for i in range(len(problems))
    ]
    outputs = vllm_engine.generate([p.prompt for p in problems], params, use_tqdm=False)
    served, seqs, parsed = [], [], 0
    for problem, out in zip(problems, outputs, strict=True):
        assert list(out.prompt_token_ids) == tokenizer(problem.prompt)["input_ids"]  # same BOS + chars
        for sample in out.outputs:
            ids = list(sample.token_ids)
            served.append([step[tok].logprob for step, tok in zip(sample.logprobs, ids, strict=True)])
            seqs.append((list(out.prompt_token_ids), ids))
            body = ids[:-1] if ids and ids[-1] == tokenizer.eos_token_id else ids
            assert sample.text == tokenizer.decode(body, skip_special_tokens=True)
            parsed += extract_answer(sample.text) is not None
    worst, bound = logprob_parity(served, seqs, model, hf64, temperature)
    print(f"vLLM vs exact at T={temperature}: max |dlogp| {worst:.2e} (float32 bound {bound:.2e}) "
          f"over {sum(len(c) for _, c in seqs)} tokens")
    assert worst <= bound
    assert parsed >= 0.9 * 4 * len(problems)


@pytest.mark.slow
def test_vllm_greedy_matches_hf_greedy(vllm_engine, hf, eval_problems):
    from vllm import SamplingParams

    model, tokenizer = hf
    problems = eval_problems[:128]
    max_tokens = get_task(problems[0].meta["task"]).max_new_tokens  # what evaluate_accuracy uses
    outputs = vllm_engine.generate(
        [p.prompt for p in problems], SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False
    )
    hf_greedy = evaluate_accuracy(model, problems, tokenizer=tokenizer, temperature=0.0).completions
    same = sum(out.outputs[0].text == cs[0] for out, cs in zip(outputs, hf_greedy, strict=True))
    # Two float32 implementations pick different argmaxes only where the top two logits are within their
    # rounding difference (~1e-4) of each other: a near-tie, rare in ~10 tokens of a trained model. 5% of
    # the prompts may diverge; a real mismatch (other weights, a shifted position) diverges on most.
    assert same >= 0.95 * len(problems)


# ---- the builder ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.isolated  # builds into tmp_path only
def test_build_is_deterministic_and_cached(tmp_path):
    a = build_tiny_model(tmp_path / "a", seed=0, config=SHORT, progress=False)
    b = build_tiny_model(tmp_path / "b", seed=0, config=SHORT, progress=False)
    record_a = read_build_record(a)
    assert record_a["sha256"] == read_build_record(b)["sha256"] == sha256_file(a / MODEL_FILE)
    assert record_a["sft_steps"] == 30 and record_a["reached_target"] is False

    # same config and seed: returned at once, nothing rewritten
    before = {name: (a / name).stat().st_mtime_ns for name in (MODEL_FILE, BUILD_RECORD)}
    assert build_tiny_model(a, seed=0, config=SHORT, progress=False) == a
    assert {name: (a / name).stat().st_mtime_ns for name in before} == before

    # force rebuilds (same bytes); another seed replaces the build in place
    build_tiny_model(b, seed=0, config=SHORT, force=True, progress=False)
    assert (b / BUILD_RECORD).stat().st_mtime_ns > before[BUILD_RECORD]
    assert read_build_record(b)["sha256"] == record_a["sha256"]
    build_tiny_model(a, seed=1, config=SHORT, progress=False)
    record_a1 = read_build_record(a)
    assert record_a1["seed"] == 1 and record_a1["sha256"] != record_a["sha256"]

    # no temporary or old directories left behind; readable by other users (services, containers)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["a", "b"]
    assert a.stat().st_mode & 0o777 == 0o755
    assert all(path.stat().st_mode & 0o777 == 0o644 for path in a.iterdir())


def test_failed_build_leaves_nothing(tmp_path, monkeypatch):
    import forkrl.models.tiny as tiny

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(tiny, "_train", boom)
    with pytest.raises(RuntimeError, match="boom"):
        build_tiny_model(tmp_path / "m", progress=False)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == []


def test_refuses_to_replace_a_directory_it_did_not_build(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="is not a forkrl tiny build"):
        build_tiny_model(tmp_path / "m", progress=False)
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["config.json"]


def test_incomplete_directory_is_not_a_cache_hit(tmp_path):
    (tmp_path / BUILD_RECORD).write_text(json.dumps({"config_hash": SHORT.hash(0), "sha256": "0" * 64}))
    assert read_build_record(tmp_path) is None


def test_the_committed_default_is_never_rebuilt_as_a_side_effect(monkeypatch):
    import forkrl.models.tiny as tiny

    monkeypatch.delenv("FORKRL_MODEL_DIR", raising=False)
    assert build_tiny_model(default_model_dir(), progress=False) == default_model_dir()  # the cached build
    monkeypatch.setattr(tiny, "_train", None)  # a cache miss must fail before any training
    with pytest.raises(ValueError, match="committed default"):
        build_tiny_model(default_model_dir(), config=SHORT, progress=False)


def test_cli_help_does_not_import_torch():
    code = "import sys, forkrl.models.tiny; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
    out = subprocess.run(
        [sys.executable, "-m", "forkrl.models.tiny", "build", "--help"],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "--force" in out.stdout


@pytest.mark.slow
def test_cli_build_reuses_the_cached_model(tiny_model_dir):
    before = (tiny_model_dir / MODEL_FILE).stat().st_mtime_ns
    out = subprocess.run(
        [sys.executable, "-m", "forkrl.models.tiny", "build", "--out", str(tiny_model_dir)],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert str(tiny_model_dir) in out.stdout and "params" in out.stdout
    assert (tiny_model_dir / MODEL_FILE).stat().st_mtime_ns == before
