"""JSONL loading: field aliases, GSM8K and boxed answers, chat prompts, errors, splits."""

import json

import pytest

from forkrl.data.datasets import DATASET_ENV, load_jsonl, load_problems, normalize_answer
from forkrl.data.tasks import make_split, split_of


def write_jsonl(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_field_aliases(tmp_path):
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "p1", "answer": "1"},
            {"question": "p2", "solution": "so \\boxed{\\frac{1}{2}}."},
            {"problem": "p3", "ground_truth": 3},
            {"prompt": "p4", "reward_model": {"ground_truth": "4", "style": "rule"}},
        ],
    )
    problems = load_jsonl(path)
    assert [(p.prompt, p.answer) for p in problems] == [
        ("p1", "1"),
        ("p2", "\\frac{1}{2}"),
        ("p3", "3"),
        ("p4", "4"),
    ]
    assert problems[1].meta == {"source": str(path), "line": 2}


def test_gsm8k_answer_keeps_the_final_number(tmp_path):
    gsm = {"question": "How many?", "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 1,234"}
    (problem,) = load_jsonl(write_jsonl(tmp_path / "g.jsonl", [gsm]))
    assert problem.answer == "1234"
    assert normalize_answer("#### $42") == "42"
    assert normalize_answer(" 7 ") == "7"
    assert normalize_answer(2.5) == "2.5"


def test_chat_prompt_takes_the_last_user_message(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    (problem,) = load_jsonl(write_jsonl(tmp_path / "c.jsonl", [{"prompt": chat, "answer": "4"}]))
    assert problem.prompt == "What is 2+2?"
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": [{"role": "system", "content": "x"}], "answer": "4"}])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: chat-style prompt has no user message"):
        load_jsonl(bad)


def test_blank_lines_are_skipped_and_line_numbers_count_them(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n   \n{"prompt": "b", "answer": "2"}\n')
    assert [p.meta["line"] for p in load_jsonl(path)] == [1, 4]


def test_malformed_json_names_file_and_line(tmp_path):
    path = write_jsonl(
        tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, "", '{"prompt": "b", "answer":']
    )
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        load_jsonl(path)


def test_missing_fields_name_the_line_and_the_accepted_names(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"prompt": "a", "answer": "1"}, {"text": "b", "answer": "2"}])
    with pytest.raises(
        ValueError, match=r"m\.jsonl:2: no prompt field; accepted names: prompt, question, problem"
    ):
        load_jsonl(path)
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": "a", "label": "1"}])
    with pytest.raises(ValueError, match=r"n\.jsonl:1: no answer field; accepted names: answer, solution"):
        load_jsonl(path)
    path = write_jsonl(tmp_path / "o.jsonl", [["not", "an", "object"]])
    with pytest.raises(ValueError, match=r"o\.jsonl:1: expected a JSON object"):
        load_jsonl(path)
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "answer": {"x": 1}}])
    with pytest.raises(ValueError, match=r"p\.jsonl:1: answer must be a string or a number"):
        load_jsonl(path)


def test_empty_or_missing_dataset_is_an_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        load_jsonl(empty)
    with pytest.raises(ValueError, match="not found"):
        load_jsonl(tmp_path / "nope.jsonl")
    monkeypatch.delenv(DATASET_ENV, raising=False)
    with pytest.raises(ValueError, match=DATASET_ENV):
        load_jsonl()


def test_path_from_environment(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "env.jsonl", [{"prompt": "a", "answer": "1"}])
    monkeypatch.setenv(DATASET_ENV, str(path))
    assert [p.prompt for p in load_jsonl()] == ["a"]


def _many(tmp_path, n=200):
    return write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)])


def test_load_problems_hash_split_is_disjoint_and_complete(tmp_path):
    path = str(_many(tmp_path))
    train = load_problems(dataset=path, split="train", n=None, seed=0)
    evals = load_problems(dataset=path, split="eval", n=None, seed=0)
    assert {p.prompt for p in train}.isdisjoint(p.prompt for p in evals)
    assert len(train) + len(evals) == 200 and 5 <= len(evals) <= 40
    assert all(split_of("jsonl", p.prompt) == "eval" for p in evals)
    # seeded order; a different seed reorders the same problems
    assert train == load_problems(dataset=path, split="train", n=None, seed=0)
    other = load_problems(dataset=path, split="train", n=None, seed=1)
    assert other != train and sorted(p.prompt for p in other) == sorted(p.prompt for p in train)


def test_load_problems_cycles_past_one_epoch(tmp_path):
    path = str(_many(tmp_path, 20))
    pool = load_problems(dataset=path, split="train", n=None, seed=0)
    more = load_problems(dataset=path, split="train", n=3 * len(pool) + 1, seed=0)
    assert len(more) == 3 * len(pool) + 1
    assert more[: len(pool)] == pool
    # every epoch holds each problem exactly once
    epoch2 = more[len(pool) : 2 * len(pool)]
    assert sorted(p.prompt for p in epoch2) == sorted(p.prompt for p in pool)


def test_load_problems_split_placeholder_uses_whole_files(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", [{"prompt": f"t{i}", "answer": "1"} for i in range(5)])
    write_jsonl(tmp_path / "eval.jsonl", [{"prompt": f"e{i}", "answer": "1"} for i in range(3)])
    pattern = str(tmp_path / "{split}.jsonl")
    assert len(load_problems(dataset=pattern, split="train")) == 5
    assert sorted(p.prompt for p in load_problems(dataset=pattern, split="eval")) == ["e0", "e1", "e2"]


def test_load_problems_picks_task_or_dataset(tmp_path, monkeypatch):
    monkeypatch.delenv(DATASET_ENV, raising=False)
    assert load_problems(task="sum3", split="eval", n=5, seed=0) == make_split("sum3", "eval", 5, 0)
    assert load_problems(split="eval", n=5, seed=0) == make_split("countdown", "eval", 5, 0)  # the default task
    path = str(_many(tmp_path))
    monkeypatch.setenv(DATASET_ENV, path)
    assert load_problems(split="train", n=4) == load_problems(dataset=path, split="train", n=4)
    with pytest.raises(ValueError, match="mutually exclusive"):
        load_problems(task="sum3", dataset=path)
    with pytest.raises(ValueError, match="split must be one of"):
        load_problems(task="sum3", split="dev", n=1)
    with pytest.raises(ValueError, match="n is required"):
        load_problems(task="sum3", split="train", n=None)
