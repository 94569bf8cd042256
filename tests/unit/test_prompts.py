"""Prompt formats (forkrl/data/prompts.py): the text and token ids of each format, the chat template's checks, and
the answer extraction each format is paired with."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from forkrl.data.answers import answer_line
from forkrl.data.prompts import (
    BOXED_TEMPLATE,
    DAPO_TEMPLATE,
    FORMATS,
    PromptEncoder,
    apply_template,
    check_prompt_format,
    check_reward_format,
    final_answer,
    run_reward_fn,
)
from forkrl.data.rewards import countdown_reward, exact_match, math_verify_reward
from forkrl.data.tasks import Problem
from forkrl.models.tiny import build_tokenizer

# a template in the tiny tokenizer's alphabet (printable ASCII), with its BOS written as text, as real ones do
CHAT = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture()
def tok():
    t = build_tokenizer()
    t.chat_template = CHAT
    return t


def test_raw_is_the_text_with_the_tokenizers_special_tokens_as_the_engine_encodes_it(tok):
    p = Problem("3 7 4->25:", "25")
    ids = PromptEncoder(tok, "raw").encode([p])[0]
    assert ids == tok.encode("3 7 4->25:", add_special_tokens=True)  # rollout_service/vllm_backend.py: encode
    assert ids[0] == tok.bos_token_id and len(ids) == 1 + len("3 7 4->25:")


def test_chat_puts_the_prompt_in_the_user_turn_with_one_bos(tok):
    enc = PromptEncoder(tok, "chat")
    assert enc.text(Problem("1+2=", "3")) == "<s>[user]1+2=[assistant]"
    ids = enc.encode_one(Problem("1+2=", "3"))
    assert tok.decode(ids) == "<s>[user]1+2=[assistant]"
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id  # the template's BOS, none added


def test_chat_keeps_the_rows_messages_and_adds_the_system_prompt_unless_the_row_has_one(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes"},
            {"role": "user", "content": "2+2?"}]
    row = Problem("2+2?", "4", meta={"messages": msgs})
    assert PromptEncoder(tok, "chat", "Be exact.").text(row) == \
        "<s>[system]Be exact.[user]hi[assistant]yes[user]2+2?[assistant]"
    own = Problem("2+2?", "4", meta={"messages": [{"role": "system", "content": "Mine."}, *msgs]})
    assert PromptEncoder(tok, "chat", "Be exact.").text(own).startswith("<s>[system]Mine.[user]hi")


def test_templates_wrap_the_last_user_turn_once(tok):
    p = Problem("What is 1+1?", "2")
    dapo = PromptEncoder(tok, "dapo").text(p)
    assert dapo == "<s>[user]" + DAPO_TEMPLATE.replace("{prompt}", "What is 1+1?") + "[assistant]"
    assert dapo.count("What is 1+1?") == 1
    # DAPO-Math-17k's prompts already carry DAPO's instruction: used as they are
    already = DAPO_TEMPLATE.replace("{prompt}", "What is 1+1?")
    assert apply_template(DAPO_TEMPLATE, already) == already
    assert PromptEncoder(tok, "dapo").text(Problem(already, "2")) == dapo
    assert PromptEncoder(tok, "dapo_plain").text(p) == already  # no chat template, no BOS in the text
    assert PromptEncoder(tok, "boxed_plain").text(p) == (
        "What is 1+1? Please reason step by step, and put your final answer within \\boxed{}.")
    assert PromptEncoder(tok, "boxed").text(p) == "<s>[user]" + BOXED_TEMPLATE.replace("{prompt}", p.prompt) + \
        "[assistant]"
    assert set(FORMATS) == {"raw", "chat", "dapo", "dapo_plain", "boxed", "boxed_plain"}


def test_chat_formats_need_a_chat_template_and_a_system_prompt_needs_a_chat_format():
    plain = build_tokenizer()
    for fmt in ("chat", "dapo", "boxed"):
        with pytest.raises(ValueError, match="has no chat template"):
            PromptEncoder(plain, fmt)
    assert PromptEncoder(plain, "dapo_plain").text(Problem("x", "1")).startswith("Solve the following")
    with pytest.raises(ValueError, match="system_prompt needs a chat format"):
        PromptEncoder(plain, "raw", "Be exact.")
    with pytest.raises(ValueError, match="prompt_format must be one of"):
        PromptEncoder(plain, "alpaca")


def test_check_prompt_format_reads_the_models_tokenizer(tmp_path: Path, tok):
    plain = build_tokenizer()
    plain.save_pretrained(tmp_path / "base")
    check_prompt_format(tmp_path / "base", "raw")  # nothing to check
    with pytest.raises(ValueError, match=r"model '.*base': prompt_format 'chat' applies the tokenizer's chat"):
        check_prompt_format(tmp_path / "base", "chat")
    tok.save_pretrained(tmp_path / "chat")
    check_prompt_format(tmp_path / "chat", "dapo", "Be exact.")
    no_system = build_tokenizer()  # a template that refuses a system turn (as Gemma's does)
    no_system.chat_template = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
                               "supported') }}{% endif %}" + CHAT)
    no_system.save_pretrained(tmp_path / "nosys")
    check_prompt_format(tmp_path / "nosys", "chat")
    with pytest.raises(ValueError, match="chat template fails on prompt_format 'chat' with a system prompt: "
                                         "System role not supported"):
        check_prompt_format(tmp_path / "nosys", "chat", "Be exact.")


@pytest.mark.parametrize("text,expected", [
    ("Let me think.\nAnswer: 42", "42"),
    ("answer : $\\frac{1}{2}$\n", "\\frac{1}{2}"),
    ("Answer: 3\nwait, no.\nAnswer: 5", "5"),  # the last one
    ("Answer: 7" + "x" * 400, None),  # outside the last 300 characters (DAPO's window)
    ("The answer is 9.", None),
])
def test_answer_line_is_dapos_extraction(text, expected):
    assert answer_line(text) == expected


def test_the_reward_reads_the_answer_where_the_format_puts_it():
    assert run_reward_fn("math_verify", "raw") is math_verify_reward
    dapo = run_reward_fn("math_verify", "dapo")
    assert isinstance(dapo, functools.partial) and dapo.keywords == {"answer": "answer_line"}
    assert run_reward_fn("math_verify", "boxed") is math_verify_reward
    assert run_reward_fn("countdown", "chat") is countdown_reward and run_reward_fn("exact_match", "raw") is exact_match
    for fmt in ("dapo", "dapo_plain", "boxed", "boxed_plain"):
        with pytest.raises(ValueError, match=f"prompt_format '{fmt}' asks for the answer"):
            check_reward_format("countdown", fmt)
    check_reward_format("mypkg.mod:fn", "dapo")  # a custom reward reads the answer itself


def test_final_answer_is_what_the_reward_reads():
    assert final_answer("7*3=21,21+4=25", "countdown") == "25"
    assert final_answer("so \\boxed{ 1/2 }", "math_verify", "boxed") == "1/2"
    assert final_answer("so \\boxed{3}\nAnswer: 4", "math_verify", "dapo") == "4"
    assert final_answer("no answer", "math_verify", "raw") is None
    assert final_answer("Answer: 4", "mypkg.mod:fn") is None


@pytest.mark.slow
def test_math_verify_grades_the_answer_line_under_dapo():
    probs = [Problem("q", "12"), Problem("q", "\\frac{1}{2}"), Problem("q", "3"), Problem("q", "3")]
    texts = ["Work.\nAnswer: 12", "Answer: $0.5$", "\\boxed{3}", "Answer: 4"]
    result = run_reward_fn("math_verify", "dapo")(texts, probs)
    assert result.rewards == [1.0, 1.0, 0.0, 0.0]  # a box is not an answer line
    assert result.counters["no_answer_line"] == 1
