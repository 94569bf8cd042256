"""Build the embedded default model: a tiny Llama with a character tokenizer, warm-started on `countdown`.

    python -m forkrl.models.tiny build --out DIR [--seed 0] [--force]
    python -m forkrl.models.tiny install --out DIR     # copy the committed default (no training)

The default everywhere is the committed build in forkrl/models/default (forkrl/models/embedded.py): the same
bytes on every machine. `build` regenerates a model; `--out forkrl/models/default --force` re-blesses the
committed one (then update docs/embedded-default.md's sha256 and numbers).

The result is a plain HF directory (config, model.safetensors, tokenizer, generation_config) that
`AutoModelForCausalLM`, `AutoTokenizer` and `vllm.LLM(model=DIR)` load unchanged. Supervised training
stops at the first evaluation whose sampled (T = 1) accuracy on the eval split reaches
`target_accuracy`: the skill appears suddenly, so a fixed step count would overshoot or stay on the
plateau, and RL from the plateau barely moves (tiny-rl-notes.md). Stopping low leaves RL room to improve.

The build runs on a fixed number of threads with deterministic algorithms, so the same seed gives the
same model.safetensors bytes on one machine; CPU float kernels differ between machines, so another
machine stops SFT at another step and writes other bytes (hence the committed default).
`forkrl_build.json` records the config, its hash, the measured accuracy, the time and the sha256; a
directory holding a build with the same config hash is reused at once. The build also writes SHA256SUMS
(every file's sha256). It is written to a temporary directory beside `--out` and renamed into place,
under a file lock.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from forkrl.files import atomic_dir, sha256_file
from forkrl.models.embedded import COMMITTED_DIR, install_default, manifest_problems, write_manifest
from forkrl.models.sampling import sample_completions

if TYPE_CHECKING:  # heavy imports stay out of `--help`
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from forkrl.data.rewards import RewardFn
    from forkrl.data.tasks import Problem

BUILDER_VERSION = 2  # bump when the code changes what a build produces
BUILD_RECORD = "forkrl_build.json"
MODEL_FILE = "model.safetensors"
REQUIRED_FILES = (
    "config.json",
    MODEL_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
MODEL_DIR_ENV = "FORKRL_MODEL_DIR"

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3
CHARS = tuple(chr(i) for i in range(32, 127))  # printable ASCII, so any task text in English fits


@dataclass(frozen=True)
class BuildConfig:
    task: str = "countdown"
    hidden_size: int = 128
    intermediate_size: int = 512
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 256
    # supervised warm start, stopped at target_accuracy (the steps it took: forkrl_build.json; docs/results.md)
    lr: float = 3e-3
    warmup_steps: int = 50
    batch_size: int = 128
    max_steps: int = 3000
    eval_every: int = 20
    eval_problems: int = 256
    target_accuracy: float = 0.25  # stop at the first eval at T = 1 that reaches it
    final_eval_problems: int = 512
    threads: int = 1  # fixed so the bytes do not depend on the machine; 1 also suits shared cores

    def hash(self, seed: int) -> str:
        blob = json.dumps(
            {"builder": BUILDER_VERSION, "config": dataclasses.asdict(self), "seed": seed}, sort_keys=True
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def default_model_dir() -> Path:
    """$FORKRL_MODEL_DIR, or the committed default (forkrl/models/default)."""
    env = os.environ.get(MODEL_DIR_ENV)
    return Path(env) if env else COMMITTED_DIR


def build_tokenizer(model_max_length: int = 256) -> PreTrainedTokenizerBase:
    """One token per printable ASCII character; BOS is prepended on encode (HF and vLLM alike)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
    )


def read_build_record(model_dir: str | os.PathLike) -> dict | None:
    """The build record of a complete build in `model_dir` (files present, sha256 matching), else None."""
    model_dir = Path(model_dir)
    try:
        record = json.loads((model_dir / BUILD_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not all((model_dir / name).is_file() for name in REQUIRED_FILES):
        return None
    if sha256_file(model_dir / MODEL_FILE) != record.get("sha256"):
        return None
    return record


# ---- sampling and accuracy -----------------------------------------------------------------------


@dataclass
class EvalResult:
    accuracy: float  # mean reward over all samples
    n_correct: int
    n_samples: int
    per_problem: list[float]  # mean reward of each problem's samples
    completions: list[list[str]]  # completions[i][j]: sample j of problem i


def load_model_and_tokenizer(model_dir: str | os.PathLike) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def evaluate_accuracy(
    model_or_dir: PreTrainedModel | str | os.PathLike,
    problems: Sequence[Problem],
    temperature: float = 1.0,
    n_samples: int = 1,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    max_new_tokens: int | None = None,
    seed: int = 0,
    reward_fn: RewardFn | None = None,
    batch_size: int = 512,
) -> EvalResult:
    """Accuracy of sampled (temperature > 0) or greedy (temperature 0) completions under `reward_fn`
    (default: the built-in task's own reward, else `exact_match`; a None reward counts as wrong).
    `max_new_tokens` defaults to the built-in task's limit, or 32 for other problems. Pass a tokenizer with
    an in-memory model."""
    from forkrl.data.rewards import get_reward_fn
    from forkrl.data.tasks import TASKS

    if isinstance(model_or_dir, (str, os.PathLike)):
        model, loaded_tokenizer = load_model_and_tokenizer(model_or_dir)
        tokenizer = tokenizer or loaded_tokenizer
    else:
        model = model_or_dir
        if tokenizer is None:
            raise ValueError("evaluate_accuracy: pass tokenizer= with an in-memory model")
    if max_new_tokens is None:
        tasks = {p.meta.get("task") for p in problems}
        max_new_tokens = max((TASKS[t].max_new_tokens for t in tasks if t in TASKS), default=32)
        if tasks - set(TASKS):
            max_new_tokens = max(max_new_tokens, 32)
    completions = sample_completions(
        model,
        tokenizer,
        [p.prompt for p in problems],
        temperature=temperature,
        n_samples=n_samples,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_size=batch_size,
    )
    flat_completions = [c for cs in completions for c in cs]
    flat_problems = [p for p in problems for _ in range(n_samples)]
    if reward_fn is None:
        names = {TASKS[t].reward for t in {p.meta.get("task") for p in problems} if t in TASKS}
        reward_fn = get_reward_fn(names.pop() if len(names) == 1 else "exact_match")
    rewards = [r or 0.0 for r in reward_fn(flat_completions, flat_problems).rewards]
    per_problem = [
        sum(rewards[i * n_samples : (i + 1) * n_samples]) / n_samples for i in range(len(problems))
    ]
    n_correct = int(sum(r >= 1.0 for r in rewards))
    return EvalResult(
        accuracy=sum(rewards) / max(len(rewards), 1),
        n_correct=n_correct,
        n_samples=len(rewards),
        per_problem=per_problem,
        completions=completions,
    )


# ---- the build -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _torch_settings(threads: int) -> Iterator[None]:
    """Fixed threads, deterministic kernels and a private RNG for the build; the caller's come back."""
    import torch

    old_threads, old_det = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        with torch.random.fork_rng(devices=[]):  # seeding the init must not reset the caller's RNG
            yield
    finally:
        torch.set_num_threads(old_threads)
        torch.use_deterministic_algorithms(old_det)


@contextlib.contextmanager
def _dir_lock(out_dir: Path) -> Iterator[None]:
    """One build per output dir at a time, across processes (a second caller then finds the cache)."""
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with lock_path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _batch_tensors(tokenizer, problems: list[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels (-100 on the prompt and padding) for BOS + prompt + completion + EOS."""
    import torch

    prompt_ids = tokenizer([p.prompt for p in problems], add_special_tokens=True)["input_ids"]
    target_ids = tokenizer([p.meta["completion"] for p in problems], add_special_tokens=False)["input_ids"]
    seqs = [p + t + [tokenizer.eos_token_id] for p, t in zip(prompt_ids, target_ids, strict=True)]
    width = max(map(len, seqs))
    input_ids = torch.full((len(seqs), width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (seq, p) in enumerate(zip(seqs, prompt_ids, strict=True)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, len(p) : len(seq)] = torch.tensor(seq[len(p) :])
    return input_ids, labels


def _train(cfg: BuildConfig, seed: int, out_dir: Path, progress: bool) -> dict[str, Any]:
    """Train, save into `out_dir` (which exists and is empty), return the build record (without sha)."""
    import torch
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from forkrl.data.tasks import get_task, iter_problems, make_split

    get_task(cfg.task)  # unknown task: fail before any work
    tokenizer = build_tokenizer(cfg.max_position_embeddings)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),  # vLLM samples ids past the real vocabulary otherwise
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).float()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    train_stream = iter_problems(cfg.task, "train", seed)
    eval_problems = make_split(cfg.task, "eval", cfg.eval_problems, seed=0)
    history: list[dict[str, float]] = []
    stop_acc, step = 0.0, 0
    bar = tqdm(total=cfg.max_steps, desc=f"tiny SFT ({cfg.task})", disable=not progress, file=sys.stderr)
    for step in range(1, cfg.max_steps + 1):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * min(1.0, step / cfg.warmup_steps)
        input_ids, labels = _batch_tensors(tokenizer, [next(train_stream) for _ in range(cfg.batch_size)])
        loss = model(input_ids=input_ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        bar.update(1)
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            stop_acc = evaluate_accuracy(
                model, eval_problems, tokenizer=tokenizer, temperature=1.0, seed=step
            ).accuracy
            history.append({"step": step, "loss": round(loss.item(), 4), "acc_t1": stop_acc})
            bar.set_postfix(loss=f"{loss.item():.3f}", acc_t1=f"{stop_acc:.3f}")
            if stop_acc >= cfg.target_accuracy:
                break
    bar.close()
    if stop_acc < cfg.target_accuracy:
        print(
            f"forkrl.models.tiny: warning: sampled accuracy {stop_acc:.3f} after {step} steps is below the target "
            f"{cfg.target_accuracy}; keeping this model",
            file=sys.stderr,
        )
    # a fresh, larger measurement: the stopping eval is biased upwards by the stopping rule itself
    final_problems = make_split(cfg.task, "eval", cfg.final_eval_problems, seed=1)
    final_t1 = evaluate_accuracy(model, final_problems, tokenizer=tokenizer, temperature=1.0, seed=10**6)
    final_greedy = evaluate_accuracy(model, final_problems, tokenizer=tokenizer, temperature=0.0)
    model.eval()
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # the class name transformers 4.x also knows (5.x writes its new alias "TokenizersBackend")
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(out_dir)
    return {
        "sft_steps": step,
        "reached_target": stop_acc >= cfg.target_accuracy,
        "accuracy": {
            "stop_eval_t1": stop_acc,
            "stop_eval_problems": cfg.eval_problems,
            "t1": final_t1.accuracy,
            "greedy": final_greedy.accuracy,
            "final_eval_problems": cfg.final_eval_problems,
        },
        "params": sum(p.numel() for p in model.parameters()),
        "history": history,
    }


def build_tiny_model(
    out_dir: str | os.PathLike,
    seed: int = 0,
    force: bool = False,
    config: BuildConfig | None = None,
    progress: bool = True,
) -> Path:
    """Build (or reuse) the tiny model in `out_dir`; returns the directory."""
    cfg = config or BuildConfig()
    out_dir = Path(out_dir).resolve()
    config_hash = cfg.hash(seed)
    out_dir.parent.mkdir(parents=True, exist_ok=True)

    def cached() -> bool:
        record = read_build_record(out_dir)
        return not force and record is not None and record.get("config_hash") == config_hash

    if cached():  # no lock needed to read a finished build: builds appear by rename
        return out_dir
    if out_dir == COMMITTED_DIR and not force:
        # the committed default changes only on purpose (re-blessing), never as a side effect of a cache miss
        raise ValueError(f"{out_dir} is the committed default and was built with another builder config; "
                         "re-bless it with `python -m forkrl.models.tiny build --out forkrl/models/default --force`")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / BUILD_RECORD).is_file():
        # e.g. FORKRL_MODEL_DIR pointing at a real checkpoint: never replace what we did not build
        raise ValueError(
            f"{out_dir} exists and is not a forkrl tiny build (no {BUILD_RECORD}); refusing to replace it"
        )
    with _dir_lock(out_dir):
        if cached():  # another process finished it while we waited
            return out_dir
        import torch
        import transformers

        t0 = time.monotonic()
        with atomic_dir(out_dir) as tmp:
            with _torch_settings(cfg.threads):
                record = _train(cfg, seed, tmp, progress)
            record = {
                "config_hash": config_hash,
                "builder_version": BUILDER_VERSION,
                "seed": seed,
                "config": dataclasses.asdict(cfg),
                **record,
                "build_time_s": round(time.monotonic() - t0, 2),
                "load_average": list(os.getloadavg()),
                "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
                "sha256": sha256_file(tmp / MODEL_FILE),
            }
            (tmp / BUILD_RECORD).write_text(json.dumps(record, indent=2) + "\n")
            write_manifest(tmp)
            for path in tmp.iterdir():
                path.chmod(0o644)  # the build is meant to be shared (services, docker)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m forkrl.models.tiny", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    build = sub.add_parser("build", help="build (or reuse) the tiny model; the result differs between machines")
    build.add_argument("--out", type=Path, required=True,
                       help="output dir (forkrl/models/default with --force re-blesses the committed default)")
    build.add_argument("--seed", type=int, default=0, help="seed for init, data order and sampling")
    build.add_argument("--force", action="store_true", help="rebuild even if --out holds the same build")
    build.add_argument("--task", default=BuildConfig.task, help="built-in task of the warm start (e.g. countdown)")
    install = sub.add_parser("install", help=f"copy the committed default (the same bytes everywhere; ${MODEL_DIR_ENV} "
                             "instead when set) into --out")
    install.add_argument("--out", type=Path, required=True, help="output dir (reused when it holds the same files)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
    if args.command == "install":
        out = install_default(args.out, default_model_dir())
    else:
        out = build_tiny_model(args.out, seed=args.seed, force=args.force, config=BuildConfig(task=args.task))
    record = read_build_record(out)
    assert record is not None
    acc = record["accuracy"]
    problems = manifest_problems(out)
    print(
        f"{out}: {record['params']} params, {record['sft_steps']} SFT steps, accuracy T=1 {acc['t1']:.3f} "
        f"greedy {acc['greedy']:.3f} (n={acc['final_eval_problems']}), built in {record['build_time_s']} s, "
        f"model.safetensors sha256 {record['sha256']}" + (f" (manifest: {'; '.join(problems)})" if problems else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
