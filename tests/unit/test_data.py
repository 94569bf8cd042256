"""Dataset loading: JSONL, Parquet (verl's schema), `save_to_disk` and `load_dataset` folders read to the same
problems; field aliases and mapping (nested paths), GSM8K and boxed answers, chat prompts, errors naming the file,
row and field; splits; the lazy read of a large file."""

import json
import tracemalloc
from pathlib import Path

import pytest

from forkrl.data.datasets import (
    DATASET_ENV,
    Fields,
    ProblemTable,
    benchmark_names,
    check_dataset,
    load_benchmark,
    load_eval_sets,
    load_jsonl,
    load_problems,
    normalize_answer,
    open_dataset,
)
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


def test_mixed_value_types_in_one_field_load_as_they_are(tmp_path):
    # a number in one row, a string in the next, a chat list after a plain prompt: Arrow's type inference
    # would refuse or rewrite these; the rows are normalized before they reach Arrow
    path = write_jsonl(tmp_path / "m.jsonl", [
        {"prompt": "a", "answer": 2}, {"prompt": [{"role": "user", "content": "b"}], "answer": "1.50"},
        {"prompt": "c", "answer": "[1, 2]"},
    ])
    assert [(p.prompt, p.answer) for p in load_jsonl(path)] == [("a", "2"), ("b", "1.50"), ("c", "[1, 2]")]


def test_gsm8k_answer_keeps_the_final_number(tmp_path):
    gsm = {"question": "How many?", "answer": "She has 3 + 4 = <<3+4=7>>7 apples.\n#### 1,234"}
    (problem,) = load_jsonl(write_jsonl(tmp_path / "g.jsonl", [gsm]))
    assert problem.answer == "1234"
    assert normalize_answer("#### $42") == "42"
    assert normalize_answer(" 7 ") == "7"
    assert normalize_answer(2.5) == "2.5"


def test_chat_prompt_takes_the_last_user_message_and_keeps_the_messages(tmp_path):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "What is 2+2?"},
    ]
    (problem,) = load_jsonl(write_jsonl(tmp_path / "c.jsonl", [{"prompt": chat, "answer": "4"}]))
    assert problem.prompt == "What is 2+2?"
    assert problem.meta["messages"] == chat  # for the chat prompt formats (forkrl/data/prompts.py)
    bad = write_jsonl(tmp_path / "b.jsonl", [{"prompt": [{"role": "system", "content": "x"}], "answer": "4"}])
    with pytest.raises(ValueError, match=r"b\.jsonl:1: field 'prompt': chat-style prompt has no user message"):
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
    with pytest.raises(ValueError, match=r"p\.jsonl:1: field 'answer': answer must be a string or a number"):
        load_jsonl(path)
    path = write_jsonl(tmp_path / "q.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": " ", "answer": "1"}])
    with pytest.raises(ValueError, match=r"q\.jsonl:2: field 'prompt': empty prompt"):
        load_jsonl(path)


def test_empty_or_missing_dataset_is_an_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="is empty"):
        load_jsonl(empty)
    with pytest.raises(ValueError, match="no such file or folder"):
        load_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(ValueError, match=r"unknown kind; give a \.jsonl or \.parquet file"):
        load_jsonl(write_jsonl(tmp_path / "x.txt", [{"prompt": "a", "answer": "1"}]))
    monkeypatch.delenv(DATASET_ENV, raising=False)
    with pytest.raises(ValueError, match=DATASET_ENV):
        load_jsonl()


def test_path_from_environment(tmp_path, monkeypatch):
    path = write_jsonl(tmp_path / "env.jsonl", [{"prompt": "a", "answer": "1"}])
    monkeypatch.setenv(DATASET_ENV, str(path))
    assert [p.prompt for p in load_jsonl()] == ["a"]


# ---- one dataset in every kind of file ----------------------------------------------------------------------


def _verl_rows(n=40):
    """Rows in verl's (and DAPO-Math-17k's) schema."""
    return [{"data_source": "math_dapo", "prompt": [{"role": "user", "content": f"What is {i}+{i}?"}],
             "ability": "MATH", "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
             "extra_info": {"index": i, "question": f"q{i}"}} for i in range(n)]


def _view(problems):
    return [(p.prompt, p.answer, p.meta.get("messages")) for p in problems]


def test_parquet_save_to_disk_load_dataset_and_jsonl_load_to_the_same_problems(tmp_path):
    import datasets

    rows = _verl_rows()
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "verl.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "files").mkdir()
    ds.to_parquet(str(tmp_path / "files" / "train.parquet"))  # a folder of data files (load_dataset)
    write_jsonl(tmp_path / "verl.jsonl", rows)
    expected = [(f"What is {i}+{i}?", str(2 * i), [{"role": "user", "content": f"What is {i}+{i}?"}])
                for i in range(40)]
    for source in ("verl.parquet", "saved", "files", "verl.jsonl"):
        assert _view(load_benchmark(tmp_path / source)) == expected, source
        train = load_problems(dataset=str(tmp_path / source), split="train", seed=3)
        assert _view(train) == _view(load_problems(dataset=str(tmp_path / "verl.jsonl"), split="train", seed=3))
    assert load_benchmark(tmp_path / "verl.parquet")[7].meta["row"] == 7  # 0-based row of a non-JSONL source


def test_field_mapping_reaches_nested_fields_and_names_a_missing_one(tmp_path):
    import datasets

    datasets.Dataset.from_list(_verl_rows(5)).to_parquet(str(tmp_path / "v.parquet"))
    fields = Fields(prompt="extra_info.question", answer="reward_model.ground_truth")
    assert [(p.prompt, p.answer, p.meta.get("messages")) for p in load_benchmark(tmp_path / "v.parquet", fields)] \
        == [(f"q{i}", str(2 * i), None) for i in range(5)]
    with pytest.raises(ValueError, match=r"v\.parquet: row 0: no answer field 'reward_model.truth' \(answer_field\)"):
        load_benchmark(tmp_path / "v.parquet", Fields(answer="reward_model.truth"))
    rows = _verl_rows(5)
    rows[3]["reward_model"]["ground_truth"] = ""
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "w.parquet"))
    with pytest.raises(ValueError, match=r"w\.parquet: row 3: field 'reward_model.ground_truth': empty answer"):
        load_benchmark(tmp_path / "w.parquet")


def test_a_dataset_dict_folder_uses_its_own_splits(tmp_path):
    import datasets

    train = datasets.Dataset.from_list([{"question": f"t{i}", "answer": str(i)} for i in range(6)])
    test = datasets.Dataset.from_list([{"question": f"e{i}", "answer": str(i)} for i in range(3)])
    datasets.DatasetDict(train=train, test=test).save_to_disk(str(tmp_path / "dd"))
    path = str(tmp_path / "dd")
    assert sorted(p.prompt for p in load_problems(dataset=path, split="train")) == [f"t{i}" for i in range(6)]
    assert sorted(p.prompt for p in load_problems(dataset=path, split="eval")) == ["e0", "e1", "e2"]
    assert [p.prompt for p in load_benchmark(path)] == ["e0", "e1", "e2"]  # a benchmark folder: its test split
    datasets.DatasetDict(a=train, b=test).save_to_disk(str(tmp_path / "ab"))
    with pytest.raises(ValueError, match=r"splits \['a', 'b'\]; expected train"):
        load_problems(dataset=str(tmp_path / "ab"), split="train")


def test_the_normalized_table_is_cached_until_the_file_changes(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}])
    first = open_dataset(path)
    assert first.table.cache_files  # memory-mapped from the datasets cache
    assert open_dataset(path).table.cache_files == first.table.cache_files
    write_jsonl(path, [{"prompt": "b", "answer": "2"}, {"prompt": "c", "answer": "3"}])
    assert [p.prompt for p in open_dataset(path)] == ["b", "c"]


@pytest.mark.slow
def test_a_large_parquet_is_streamed_not_loaded_into_python_objects(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    n, width = 12000, 4000  # 48 MB of prompt text (Parquet compresses it to a few MB)
    pq.write_table(pa.table({
        "prompt": [[{"role": "user", "content": f"{i} " + "x" * width}] for i in range(n)],
        "reward_model": [{"ground_truth": str(i), "style": "rule"} for i in range(n)],
    }), tmp_path / "big.parquet", row_group_size=1000)
    tracemalloc.start()
    try:
        table = open_dataset(tmp_path / "big.parquet", "train")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # every prompt as a Python str at once would take more than n * width bytes; the stream holds a few batches
    assert peak < n * width / 2, peak
    assert isinstance(table, ProblemTable) and len(table) == sum(split_of("jsonl", f"{i} " + "x" * width) == "train"
                                                                 for i in range(n))
    i = int(table.index[5])
    assert (table[5].prompt, table[5].answer) == (f"{i} " + "x" * width, str(i))  # read when asked for


# ---- splits ------------------------------------------------------------------------------------------------


def _many(tmp_path, n=200):
    return write_jsonl(tmp_path / "many.jsonl", [{"prompt": f"q{i}", "answer": str(i)} for i in range(n)])


def test_load_problems_hash_split_is_disjoint_and_complete(tmp_path):
    path = str(_many(tmp_path))
    train = list(load_problems(dataset=path, split="train", n=None, seed=0))
    evals = list(load_problems(dataset=path, split="eval", n=None, seed=0))
    assert {p.prompt for p in train}.isdisjoint(p.prompt for p in evals)
    assert len(train) + len(evals) == 200 and 5 <= len(evals) <= 40
    assert all(split_of("jsonl", p.prompt) == "eval" for p in evals)
    # seeded order; a different seed reorders the same problems
    assert train == list(load_problems(dataset=path, split="train", n=None, seed=0))
    other = list(load_problems(dataset=path, split="train", n=None, seed=1))
    assert other != train and sorted(p.prompt for p in other) == sorted(p.prompt for p in train)


def test_the_seeded_order_is_the_one_of_earlier_versions(tmp_path):
    # a run resumed across versions walks the same prompts: the order is a random.Random shuffle of the split
    # in file order, seeded "forkrl:data:<seed>:<epoch>" (the rows are no longer Python objects, the order is)
    import random

    path = str(_many(tmp_path, 30))
    pool = [p for p in load_jsonl(path) if split_of("jsonl", p.prompt) == "train"]
    random.Random("forkrl:data:5:0").shuffle(pool)
    assert [p.prompt for p in load_problems(dataset=path, split="train", seed=5)] == [p.prompt for p in pool]


def test_load_problems_cycles_past_one_epoch(tmp_path):
    path = str(_many(tmp_path, 20))
    pool = list(load_problems(dataset=path, split="train", n=None, seed=0))
    more = list(load_problems(dataset=path, split="train", n=3 * len(pool) + 1, seed=0))
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
    assert list(load_problems(split="train", n=4)) == list(load_problems(dataset=path, split="train", n=4))
    with pytest.raises(ValueError, match="mutually exclusive"):
        load_problems(task="sum3", dataset=path)
    with pytest.raises(ValueError, match="split must be one of"):
        load_problems(task="sum3", split="dev", n=1)
    with pytest.raises(ValueError, match="n is required"):
        load_problems(task="sum3", split="train", n=None)


def test_eval_sets_are_the_eval_split_or_the_first_problems_of_each_benchmark(tmp_path):
    a = write_jsonl(tmp_path / "aime24.jsonl", [{"problem": f"a{i}", "answer": str(i)} for i in range(5)])
    b = write_jsonl(tmp_path / "sub" / "aime24.jsonl" if (tmp_path / "sub").mkdir() is None else None,
                    [{"problem": f"b{i}", "answer": str(i)} for i in range(2)])
    sets = load_eval_sets(None, None, [str(a), str(b)], 3, seed=0)
    assert [(name, [p.prompt for p in ps]) for name, ps in sets] == [("aime24", ["a0", "a1", "a2"]),
                                                                     ("aime24-2", ["b0", "b1"])]
    assert load_eval_sets("sum3", None, [], 0, seed=0) == []
    ((name, problems),) = load_eval_sets("sum3", None, [], 4, seed=0)
    assert name == "" and problems == make_split("sum3", "eval", 4, 0)
    assert benchmark_names(["x/math500.parquet", "y/gsm8k_saved/", "z/a b.jsonl"]) == ["math500", "gsm8k_saved",
                                                                                        "a_b"]


def test_a_split_template_is_replaced_literally_never_formatted(tmp_path):
    """issue 42 item 2: `{split}` was filled with str.format, so a format spec in the path chose the file:
    `{split:.<2.0}` formats to `..` (the run read a file outside its folder)."""
    (tmp_path / "root" / "train").mkdir(parents=True)
    write_jsonl(tmp_path / "secret.jsonl", [{"prompt": "outside", "answer": "1"}])
    climb = str(tmp_path / "root" / "{split}" / "{split:.<2.0}" / "{split:.<2.0}" / "secret.jsonl")
    for path in (climb, str(tmp_path / "{split:>100000000}.jsonl"), str(tmp_path / "{0}-{split}.jsonl"),
                 str(tmp_path / "{split}}.jsonl")):
        with pytest.raises(ValueError, match="^dataset: '.*' is not a field a dataset path may hold"):
            load_problems(dataset=path, split="train")
        with pytest.raises(ValueError, match="is not a field a dataset path may hold"):
            check_dataset(path, ("train",))
    from forkrl.data.datasets import split_path

    assert split_path("d/{split}/{split}.jsonl", "eval") == "d/eval/eval.jsonl"
    assert split_path("d/all.jsonl", "train") == "d/all.jsonl"
    with pytest.raises(ValueError, match="split must be one of"):
        split_path("d/{split}.jsonl", "..")


def test_datasets_is_pinned_to_a_version_that_runs_no_loading_script(tmp_path, monkeypatch):
    """issue 42 item 12: `datasets>=3.0` allowed 3.x, which honours HF_DATASETS_TRUST_REMOTE_CODE and runs a
    folder's loading script. The pin excludes every 3.x, the installed version satisfies it, and a folder with a
    loading script is refused without running it (even with the variable set)."""
    import importlib.metadata

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    (pin,) = [Requirement(r) for r in pyproject["project"]["dependencies"] if Requirement(r).name == "datasets"]
    assert not any(pin.specifier.contains(v) for v in ("3.0.0", "3.6.0", "3.99")), pin
    assert pin.specifier.contains(importlib.metadata.version("datasets")), pin

    marker = tmp_path / "ran"
    folder = tmp_path / "scripted"
    folder.mkdir()
    (folder / "scripted.py").write_text(f"open({str(marker)!r}, 'w').close()\nimport datasets\n")
    write_jsonl(folder / "data.jsonl", [{"prompt": "p", "answer": "1"}])
    monkeypatch.setenv("HF_DATASETS_TRUST_REMOTE_CODE", "1")
    with pytest.raises(ValueError, match=r"holds a loading script \(scripted\.py\); forkrl never runs a dataset's"):
        load_benchmark(folder, cache_dir=str(tmp_path / "cache"))
    assert not marker.exists()
