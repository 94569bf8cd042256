"""Prompt formats: how a problem becomes the token ids the model samples from, and where its answer must be.

One definition for training (`--prompt-format`, RunConfig), the recipes, the probe and `python -m forkrl.eval`:

    raw          the prompt text as it is, encoded with the tokenizer's special tokens (BOS) — the default
    chat         the tokenizer's chat template: the prompt as the user turn, or the row's own message list
                 (a dataset row whose prompt is [{"role", "content"}, ...]); --system-prompt adds a system turn
    dapo         DAPO's math prompt (arXiv 2503.14476; the prompt of DAPO-Math-17k, which the 80/20 paper trained
                 on) as the user turn of the chat template; the answer goes on a last line "Answer: ..."
    dapo_plain   the same text without a chat template (a base model that has none)
    boxed        "... Please reason step by step, and put your final answer within \\boxed{}." as the user turn
                 of the chat template; the answer is the last \\boxed{...}
    boxed_plain  the same text without a chat template

A prompt that already is the template's text (DAPO-Math-17k's prompts carry DAPO's instruction) is used as it
is, never wrapped twice. Each format is paired with the answer extraction of the reward (`run_reward_fn`):
`math_verify` reads the "Answer:" line under dapo/dapo_plain (DAPO's extraction: the last match of
`Answer\\s*:\\s*(.+)` in the last 300 characters, algorithms.md §5) and the last \\boxed{} otherwise; the built-in
tasks' rewards (exact_match, countdown) read the task's own format, so a template format with them is an error.

The trainer formats and tokenizes (`PromptEncoder`), and the rollout service receives token ids: the ids the
engine samples from are exactly those the trainer's log-probs are computed on.

    enc = PromptEncoder(tokenizer, "chat", system_prompt="You are a careful mathematician.")
    ids = enc.encode(problems)                        # one token-id list per problem
    reward_fn = run_reward_fn("math_verify", "dapo")  # grades the "Answer:" line with math-verify

Imports nothing heavy (the CLIs' --help): transformers is only needed by `check_prompt_format`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from forkrl.data.answers import answer_line, extract_answer, last_boxed_only_string, remove_boxed
from forkrl.data.problem import Problem
from forkrl.data.rewards import get_reward_fn, math_verify_reward

PromptFormat = Literal["raw", "chat", "dapo", "dapo_plain", "boxed", "boxed_plain"]
AnswerStyle = Literal["boxed", "answer_line"]

DAPO_TEMPLATE = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{prompt}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)
BOXED_TEMPLATE = "{prompt} Please reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class FormatSpec:
    name: str
    chat: bool  # through the tokenizer's chat template
    template: str | None  # the user turn, "{prompt}" standing for the problem; None = the prompt as it is
    answer: AnswerStyle | None  # where the answer must be; None = the reward's own (the task's format, \boxed{})


FORMATS: dict[str, FormatSpec] = {
    "raw": FormatSpec("raw", False, None, None),
    "chat": FormatSpec("chat", True, None, None),
    "dapo": FormatSpec("dapo", True, DAPO_TEMPLATE, "answer_line"),
    "dapo_plain": FormatSpec("dapo_plain", False, DAPO_TEMPLATE, "answer_line"),
    "boxed": FormatSpec("boxed", True, BOXED_TEMPLATE, "boxed"),
    "boxed_plain": FormatSpec("boxed_plain", False, BOXED_TEMPLATE, "boxed"),
}
TASK_REWARDS = ("exact_match", "countdown")  # read the built-in tasks' own answer format


def format_spec(name: str) -> FormatSpec:
    if name not in FORMATS:
        raise ValueError(f"prompt_format must be one of {', '.join(FORMATS)}, got {name!r}")
    return FORMATS[name]


def check_format_options(prompt_format: str, system_prompt: str) -> None:
    """ValueError for a system prompt on a format without a chat template (it would have nowhere to go)."""
    if system_prompt and not format_spec(prompt_format).chat:
        raise ValueError(f"system_prompt needs a chat format (chat, dapo, boxed); prompt_format is {prompt_format!r}")


def apply_template(template: str | None, text: str) -> str:
    """The template's text around `text`; `text` itself when it already is the template's text (both the parts
    before and after "{prompt}" present) or when there is no template."""
    if template is None:
        return text
    head, _, tail = template.partition("{prompt}")
    if text.startswith(head.strip()) and tail.strip() in text:
        return text
    return head + text + tail


def _messages(problem: Problem) -> list[dict[str, Any]]:
    rows = problem.meta.get("messages") if isinstance(problem.meta, dict) else None
    if rows:
        return [{k: v for k, v in m.items() if v is not None} for m in rows]
    return [{"role": "user", "content": problem.prompt}]


class PromptEncoder:
    """Token ids of problems in one prompt format, with one tokenizer (that of the model being sampled).
    Thread-safe: `encode` holds a lock (the async sampler and the evaluation may encode at the same time, and a
    fast tokenizer is one Rust object); give it a tokenizer nothing else uses concurrently (a copy)."""

    def __init__(self, tokenizer: Any, prompt_format: str = "raw", system_prompt: str = "") -> None:
        check_format_options(prompt_format, system_prompt)
        self.tok, self.spec, self.system_prompt = tokenizer, format_spec(prompt_format), system_prompt
        self._lock = threading.Lock()
        if self.spec.chat and not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"prompt_format {prompt_format!r} applies the tokenizer's chat template, and the "
                             "tokenizer has no chat template; use raw (or dapo_plain / boxed_plain)")

    def messages(self, problem: Problem) -> list[dict[str, Any]]:
        """The conversation of a chat format: the row's messages (or the prompt as the user turn), the template
        applied to the last user turn, the system prompt first unless the row has a system turn of its own."""
        msgs = _messages(problem)
        if self.spec.template is not None:
            last = max((i for i, m in enumerate(msgs) if m.get("role") == "user"), default=None)
            if last is None:
                raise ValueError(f"prompt_format {self.spec.name}: the conversation has no user turn to put the "
                                 "problem in")
            msgs[last] = {**msgs[last], "content": apply_template(self.spec.template, str(msgs[last]["content"]))}
        if self.system_prompt and not any(m.get("role") == "system" for m in msgs):
            msgs.insert(0, {"role": "system", "content": self.system_prompt})
        return msgs

    def text(self, problem: Problem) -> str:
        """The prompt as the model sees it (before tokenization)."""
        if self.spec.chat:
            return self.tok.apply_chat_template(self.messages(problem), add_generation_prompt=True, tokenize=False)
        return apply_template(self.spec.template, problem.prompt)

    def encode_one(self, problem: Problem) -> list[int]:
        # a chat template writes its own special tokens (BOS included, where it has one): encode them as text,
        # add none (what vLLM does for a chat request); raw text gets the tokenizer's own (what vLLM does too)
        ids = self.tok(self.text(problem), add_special_tokens=not self.spec.chat)["input_ids"]
        return [int(t) for t in ids]

    def encode(self, problems: Sequence[Problem]) -> list[list[int]]:
        with self._lock:
            return [self.encode_one(p) for p in problems]


def check_prompt_format(model_dir: str | Path, prompt_format: str, system_prompt: str = "") -> None:
    """Before any work (StartRun's preflight, the eval and probe plans): the model's tokenizer can render this
    format (a chat format needs a chat template, and the template must accept the system prompt). ValueError
    naming the model otherwise."""
    check_format_options(prompt_format, system_prompt)
    if not format_spec(prompt_format).chat:
        return
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    try:
        PromptEncoder(tok, prompt_format, system_prompt).encode([Problem("1+1", "2")])
    except ValueError as exc:
        raise ValueError(f"model {str(model_dir)!r}: {exc}") from None
    except Exception as exc:  # the template's own error (jinja2, e.g. "System role not supported")
        raise ValueError(f"model {str(model_dir)!r}: its chat template fails on prompt_format {prompt_format!r}"
                         f"{' with a system prompt' if system_prompt else ''}: {exc}") from None


# ---- the answer: what the reward reads ----------------------------------------------------------------------


def check_reward_format(reward: str, prompt_format: str) -> None:
    """ValueError when the reward would not read the answer where the format asks the model to put it."""
    spec = format_spec(prompt_format)
    if spec.answer is not None and reward in TASK_REWARDS:
        where = "on a last 'Answer:' line" if spec.answer == "answer_line" else "in \\boxed{}"
        raise ValueError(f"prompt_format {prompt_format!r} asks for the answer {where}, and reward {reward!r} reads "
                         "the built-in task's own format; use reward math_verify, or prompt_format raw or chat")


def run_reward_fn(reward: str, prompt_format: str = "raw"):
    """The reward function of a run: `get_reward_fn(reward)`, with math_verify reading the answer where the
    format puts it. A custom reward ("module:function") reads the answer itself."""
    check_reward_format(reward, prompt_format)
    fn = get_reward_fn(reward)
    if reward == "math_verify" and format_spec(prompt_format).answer == "answer_line":
        return functools.partial(math_verify_reward, answer="answer_line")
    return fn


def final_answer(text: str, reward: str, prompt_format: str = "raw") -> str | None:
    """The answer a completion gives, as the run's reward reads it (what maj@k votes on); None when it gives
    none or the reward is a custom one (its extraction is unknown here). Whitespace removed."""
    if reward in TASK_REWARDS:
        value = extract_answer(text)
    elif reward == "math_verify":
        if format_spec(prompt_format).answer == "answer_line":
            value = answer_line(text)
        else:
            boxed = last_boxed_only_string(text)
            value = remove_boxed(boxed) if boxed is not None else None
    else:
        return None
    return None if value is None else "".join(value.split())
