"""Problems for training and evaluation: the built-in synthetic task, or real math data from files.

`--dataset` takes
- a JSONL file (one JSON object per line; blank lines skipped),
- a Parquet file (verl's and DAPO-Math-17k's schema: `prompt` a list of messages, `reward_model.ground_truth`),
- a Hugging Face `datasets` folder written by `save_to_disk` (a Dataset, or a DatasetDict),
- any other local folder `datasets.load_dataset` reads (data files: parquet, json, csv, ...). A folder holding a
  loading script (`*.py`) is refused: `datasets>=4` (pyproject.toml) runs none, and forkrl refuses them anyway.

Fields: `prompt_field` and `answer_field` name them, dotted for nested ones (`reward_model.ground_truth`,
`extra_info.question`); empty = auto-detection, per row, the first present of
- prompt: `prompt`, `question`, `problem`,
- answer: `answer`, `solution`, `ground_truth`, then verl's `reward_model.ground_truth`.
A chat-style prompt (a list of {"role", "content"}) keeps its messages (the `chat` prompt formats use them,
forkrl/data/prompts.py); its text is the content of its last user message. A GSM8K answer ("... #### 1,234")
becomes the number after `####`; an answer holding a `\\boxed{...}` (a MATH solution) the content of its last
box; numbers become strings. A bad row is an error naming the file, the row (JSONL: the line) and the field.

Large files are never loaded into Python objects: one streaming pass (pyarrow's Parquet batches, the Arrow
table of a `datasets` folder, JSONL line by line) checks every row and writes the normalized rows (prompt,
messages, answer, split) into an Arrow table in the `datasets` cache (HF_DATASETS_CACHE, or `cache_dir`),
memory-mapped and reused while the file is unchanged; problems are built from it when a batch asks for them.

Splits: a file is split like the built-in tasks, by a hash of the prompt (one prompt in ten goes to `eval`),
so train and eval never share a prompt. To use separate files instead, put `{split}` in the path
(`data/{split}.parquet`); each file is then used whole for its split. `{split}` is replaced as written (a plain
replace, not str.format); any other brace in a dataset path (`{split:>9}`, `{0}`) is refused (`split_path`), and
the trainer confines each file it names (forkrl/training/rules.py). A DatasetDict folder with a `train` split
and an `eval`/`test`/`validation` split is used the same way; with one split only, that split is hash-split.

    from forkrl.data.datasets import load_problems, load_benchmark
    problems = load_problems(task=None, dataset="dapo-math-17k.parquet", split="train", seed=0)  # a Sequence
    aime = load_benchmark("aime24.jsonl")            # a whole file in file order (python -m forkrl.eval)
"""

from __future__ import annotations

import json
import os
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

from forkrl.data.answers import last_boxed_only_string, remove_boxed
from forkrl.data.tasks import DEFAULT_TASK, SPLITS, Problem, make_split, split_of

DATASET_ENV = "RL_DATASET_PATH"
SPLIT_FIELD = "{split}"  # in a dataset path: one file per split (replaced literally, never str.format)
PROMPT_FIELDS = ("prompt", "question", "problem")
ANSWER_FIELDS = ("answer", "solution", "ground_truth")
EVAL_SPLIT_NAMES = ("eval", "test", "validation")  # a DatasetDict's split used as our eval split
FORMAT_VERSION = 1  # of the normalized table: a change here must not reuse an old cache
_BATCH = 1024
_GSM8K_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


@dataclass(frozen=True)
class Fields:
    """Which fields hold the prompt and the answer ("" = auto-detection); dotted paths reach nested fields."""

    prompt: str = ""
    answer: str = ""


def normalize_answer(value: Any) -> str:
    """GSM8K `#### 42` -> "42"; a `\\boxed{x}` solution -> "x"; numbers -> str; whitespace stripped."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise TypeError(f"answer must be a string or a number, got {type(value).__name__}")
    text = str(value).strip()
    match = _GSM8K_RE.search(text)
    if match:
        return match.group(1).replace(",", "").replace("$", "").strip()
    boxed = last_boxed_only_string(text)
    if boxed is not None:
        return remove_boxed(boxed).strip()
    return text


def _get(record: dict, path: str) -> Any:
    value: Any = record
    for part in path.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _prompt(value: Any, where: str) -> tuple[str, list | None]:
    """(text, messages or None) of a prompt value: a string, or a chat list (text = its last user message)."""
    if isinstance(value, str):
        return value, None
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, dict) for m in value):
        users = [m.get("content") for m in value if m.get("role") == "user"]
        if users and isinstance(users[-1], str):
            return users[-1], [dict(m) for m in value]
        raise ValueError(f"{where}: chat-style prompt has no user message with string content")
    kind = type(value).__name__
    raise ValueError(f"{where}: prompt must be a string or a list of {{role, content}}, got {kind}")


def normalize_row(record: Any, where: str, fields: Fields = Fields()) -> dict[str, Any]:
    """One source row -> {"prompt", "messages" (JSON text or None), "answer"}; ValueError naming `where` and the
    field for a bad row."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if fields.prompt:
        key, value = fields.prompt, _get(record, fields.prompt)
        if value is None:
            raise ValueError(f"{where}: no prompt field {key!r} (prompt_field)")
    else:
        key = next((k for k in PROMPT_FIELDS if record.get(k) is not None), None)
        if key is None:
            raise ValueError(f"{where}: no prompt field; accepted names: {', '.join(PROMPT_FIELDS)} "
                             "(or name it with prompt_field)")
        value = record[key]
    text, messages = _prompt(value, f"{where}: field {key!r}")
    if fields.answer:
        akey, answer = fields.answer, _get(record, fields.answer)
        if answer is None:
            raise ValueError(f"{where}: no answer field {akey!r} (answer_field)")
    else:
        akey = next((k for k in ANSWER_FIELDS if record.get(k) is not None), "reward_model.ground_truth")
        answer = _get(record, akey)
        if answer is None:
            raise ValueError(f"{where}: no answer field; accepted names: {', '.join(ANSWER_FIELDS)}, "
                             "reward_model.ground_truth (or name it with answer_field)")
    try:
        gold = normalize_answer(answer)
    except TypeError as exc:
        raise ValueError(f"{where}: field {akey!r}: {exc}") from None
    if not text.strip():
        raise ValueError(f"{where}: field {key!r}: empty prompt")
    if not gold:
        raise ValueError(f"{where}: field {akey!r}: empty answer")
    return {"prompt": text, "messages": json.dumps(messages) if messages is not None else None, "answer": gold}


# ---- sources: each yields (row number, record) in file order ---------------------------------------------------


def _is_saved_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json"))


def _jsonl_records(path: Path) -> Iterator[tuple[int, Any]]:
    # Line by line with the json module, not datasets' JSON builder: for a field whose type changes between rows
    # (an answer 2 here, "1.50" there: common in math JSONL) that builder stores the column as JSON and hands
    # back 1.5 for "1.50", and with blank lines in such a file it fails to parse (datasets 5.2); line numbers
    # for the errors come free. Arrow still holds the rows (the normalized table below).
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from None


def _parquet_records(path: Path) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    row = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=_BATCH):  # streamed: one batch in memory at a time
        for record in batch.to_pylist():
            yield row, record
            row += 1


def _arrow_records(ds: Any) -> Iterator[tuple[int, Any]]:
    row = 0
    for batch in ds.iter(batch_size=_BATCH):  # memory-mapped Arrow, converted one batch at a time
        keys = list(batch)
        for values in zip(*(batch[k] for k in keys), strict=True):
            yield row, dict(zip(keys, values, strict=True))
            row += 1


def _load_folder(path: Path) -> Any:
    import datasets

    if _is_saved_dataset(path):
        return datasets.load_from_disk(str(path))
    scripts = sorted(p.name for p in path.glob("*.py"))
    if scripts:  # datasets < 4 ran such a script (HF_DATASETS_TRUST_REMOTE_CODE); forkrl runs no code of a dataset
        raise ValueError(f"dataset {path}: holds a loading script ({', '.join(scripts[:3])}); forkrl never runs "
                         "a dataset's code: give its data files (parquet, jsonl, ...) or a `save_to_disk` folder")
    try:
        return datasets.load_dataset(str(path))
    except Exception as exc:  # noqa: BLE001 - the library's own message says what it found (no data files, ...)
        raise ValueError(f"dataset {path}: a folder neither `save_to_disk` wrote nor `load_dataset` reads: "
                         f"{type(exc).__name__}: {exc}") from None


def _folder_split(path: Path, split: str | None) -> tuple[str, bool]:
    """(the folder's split to read, "" = the folder is one Dataset; whole): `whole` when that split is used as
    ours as it is; split None = the whole folder (a benchmark): its only split, else `test`."""
    import datasets

    data = _load_folder(path)
    if isinstance(data, datasets.Dataset):
        return "", split is None
    names = list(data)
    if len(names) == 1:
        return names[0], split is None
    wanted = ("train",) if split == "train" else EVAL_SPLIT_NAMES if split == "eval" else ("test", *EVAL_SPLIT_NAMES)
    for name in wanted:
        if name in data:
            return name, True
    raise ValueError(f"dataset {path}: splits {names}; expected train and one of {', '.join(EVAL_SPLIT_NAMES)} "
                     "(or a folder with one split)")


def _kind(path: Path) -> str:
    if path.is_dir():
        return "folder"
    if not path.exists():
        raise ValueError(f"dataset: no such file or folder {str(path)!r}")
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in (".jsonl", ".json", ".ndjson"):
        return "jsonl"
    raise ValueError(f"dataset {path}: unknown kind; give a .jsonl or .parquet file, or a `datasets` folder")


def _records(path: Path, kind: str, split_name: str) -> Iterator[tuple[int, Any]]:
    if kind == "jsonl":
        return _jsonl_records(path)
    if kind == "parquet":
        return _parquet_records(path)
    data = _load_folder(path)
    return _arrow_records(data[split_name] if split_name else data)


def _rows(path: str, kind: str, split_name: str, fields: tuple[str, str], key: Any) -> Iterator[dict]:
    """The normalized rows: the generator `datasets` writes into its Arrow cache (`key` only keys that cache)."""
    empty = True
    for row, record in _records(Path(path), kind, split_name):
        where = f"{path}:{row}" if kind == "jsonl" else f"{path}: row {row}"
        out = normalize_row(record, where, Fields(*fields))
        empty = False
        yield {**out, "row": row, "split": split_of("jsonl", out["prompt"])}
    if empty:
        raise ValueError(f"dataset {path} is empty")


def _fingerprint(path: Path) -> tuple[int, int]:
    """(bytes, newest mtime) of a file or of every file under a folder: a change makes a new cache entry."""
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    stats = [f.stat() for f in files]
    return sum(s.st_size for s in stats), max((s.st_mtime_ns for s in stats), default=0)


def _normalized(path: Path, split: str | None, fields: Fields, cache_dir: str | None) -> tuple[Any, bool, str]:
    """(the normalized Dataset, whole, kind)."""
    import datasets

    kind = _kind(path)
    split_name, whole = _folder_split(path, split) if kind == "folder" else ("", split is None)
    key = (str(path.resolve()), kind, split_name, *_fingerprint(path), FORMAT_VERSION)
    features = datasets.Features({"prompt": datasets.Value("string"), "messages": datasets.Value("string"),
                                  "answer": datasets.Value("string"), "row": datasets.Value("int64"),
                                  "split": datasets.Value("string")})
    datasets.disable_progress_bars()
    try:
        ds = datasets.Dataset.from_generator(
            _rows, features=features, cache_dir=cache_dir,
            gen_kwargs={"path": str(path), "kind": kind, "split_name": split_name,
                        "fields": (fields.prompt, fields.answer), "key": key})
    except datasets.exceptions.DatasetGenerationError as exc:
        cause = exc.__cause__ or exc.__context__
        if isinstance(cause, ValueError):
            raise ValueError(str(cause)) from None
        raise
    return ds, whole, kind


class ProblemTable(Sequence[Problem]):
    """Problems read from a normalized Arrow table when asked for; `index[i]` is the table row of problem i."""

    def __init__(self, table: Any, index: Sequence[int], source: str, kind: str) -> None:
        self.table, self.index, self.source, self.kind = table, index, source, kind

    def __len__(self) -> int:
        return len(self.index)

    @overload
    def __getitem__(self, i: int) -> Problem: ...
    @overload
    def __getitem__(self, i: slice) -> list[Problem]: ...

    def __getitem__(self, i: int | slice) -> Problem | list[Problem]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        r = self.table[int(self.index[i])]
        meta: dict[str, Any] = {"source": self.source, "line" if self.kind == "jsonl" else "row": r["row"]}
        if r["messages"] is not None:
            meta["messages"] = json.loads(r["messages"])
        return Problem(prompt=r["prompt"], answer=r["answer"], meta=meta)

    def reorder(self, positions: Sequence[int]) -> ProblemTable:
        """The problems at `positions`, in that order (no row is read)."""
        return ProblemTable(self.table, [self.index[p] for p in positions], self.source, self.kind)


def open_dataset(path: str | os.PathLike, split: str | None = None, fields: Fields = Fields(),
                 cache_dir: str | None = None) -> ProblemTable:
    """The problems of `split` ("train"/"eval": the hash split, or the file whole when it is the split's own)
    or, with split None, of the whole source, in file order. ValueError naming file, row and field."""
    import numpy as np
    import pyarrow.compute as pc

    path = Path(path).expanduser()
    ds, whole, kind = _normalized(path, split, fields, cache_dir)
    if whole:
        index: Sequence[int] = range(len(ds))
    else:
        index = pc.indices_nonzero(pc.equal(ds.data.column("split"), split)).to_numpy().astype(np.int64)
        if not len(index):
            raise ValueError(f"dataset {path} has no {split} problems (hash split: 1 prompt in 10 is eval)")
    return ProblemTable(ds, index, str(path), kind)


def load_benchmark(path: str | os.PathLike, fields: Fields = Fields(), cache_dir: str | None = None) -> ProblemTable:
    """Every problem of a benchmark file or folder, in file order (no split)."""
    return open_dataset(path, None, fields, cache_dir)


def load_jsonl(path: str | os.PathLike | None = None, fields: Fields = Fields()) -> list[Problem]:
    """Every problem in a JSONL file, in file order. `path` defaults to $RL_DATASET_PATH."""
    if path is None:
        path = os.environ.get(DATASET_ENV)
        if not path:
            raise ValueError(f"no dataset path given and ${DATASET_ENV} is not set")
    return list(load_benchmark(path, fields))


def split_path(path: str, split: str, what: str = "dataset") -> str:
    """The file of `split` ("train"/"eval") that a dataset path names: each `{split}` replaced by the split's name,
    literally (str.format would honour a format spec: `{split:.<2.0}` formats to `..`, `{split:>100000000}`
    allocates 100 MB); a path without it, as it is. ValueError naming `what` and the field for any other brace
    in the path: braces in a dataset path are reserved for `{split}`. Callers confine the path this returns."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    rest = path.replace(SPLIT_FIELD, "")
    if "{" in rest or "}" in rest:
        field = re.search(r"\{[^{}]*\}?|\}", rest)
        shown = field.group(0) if field else "{"
        shown = shown if len(shown) <= 40 else shown[:40] + "..."
        raise ValueError(f"{what}: {shown!r} is not a field a dataset path may hold: only {SPLIT_FIELD!r}, exactly "
                         "as written (no format spec, no other name), is replaced, by train or eval")
    return path.replace(SPLIT_FIELD, split)


def check_dataset(path: str, splits: Sequence[str] = SPLITS, fields: Fields = Fields(),
                  cache_dir: str | None = None) -> None:
    """Before a run: the dataset reads, every row is valid and each of `splits` has problems."""
    for split in splits:
        if SPLIT_FIELD in path:
            open_dataset(split_path(path, split), None, fields, cache_dir)
        else:
            open_dataset(split_path(path, split), split, fields, cache_dir)


def _take(pool: Sequence[Problem], n: int | None, seed: int) -> Sequence[Problem]:
    """A seeded shuffle of `pool`, reshuffled and repeated until there are `n`; all once when n is None."""
    if n is None:
        n = len(pool)
    positions: list[int] = []
    epoch = 0
    while len(positions) < n:
        order = list(range(len(pool)))
        random.Random(f"forkrl:data:{seed}:{epoch}").shuffle(order)
        positions.extend(order[: n - len(positions)])
        epoch += 1
    if isinstance(pool, ProblemTable):
        return pool.reorder(positions)
    return [pool[i] for i in positions]


def load_problems(
    task: str | None = None,
    dataset: str | None = None,
    split: str = "train",
    n: int | None = None,
    seed: int = 0,
    fields: Fields = Fields(),
    cache_dir: str | None = None,
) -> Sequence[Problem]:
    """`n` problems of `split` from the built-in `task` or from `dataset` (a list, or for a dataset a
    `ProblemTable` whose rows are read when asked for).

    With neither given: $RL_DATASET_PATH if set, else the default task. For a dataset, `n=None` means
    every problem of the split once; a larger `n` cycles through it in a new seeded order each pass.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if task and dataset:
        raise ValueError("task and dataset are mutually exclusive: give one")
    if not task and not dataset:
        dataset = os.environ.get(DATASET_ENV) or None
        task = None if dataset else DEFAULT_TASK
    if task:
        if n is None:
            raise ValueError("n is required for a built-in task (its problems are generated)")
        return make_split(task, split, n, seed)
    assert dataset is not None
    if SPLIT_FIELD in dataset:
        pool = open_dataset(split_path(dataset, split), None, fields, cache_dir)
    else:
        pool = open_dataset(split_path(dataset, split), split, fields, cache_dir)
    return _take(pool, n, seed)


def benchmark_names(paths: Sequence[str]) -> list[str]:
    """A short, unique, metric-safe name per benchmark path: its file stem (aime24.jsonl -> aime24) or folder name."""
    names: list[str] = []
    for path in paths:
        p = Path(path.rstrip("/"))
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", p.stem if p.suffix in (".jsonl", ".json", ".ndjson", ".parquet")
                      else p.name) or "benchmark"
        name, k = base, 1
        while name in names:
            k += 1
            name = f"{base}-{k}"
        names.append(name)
    return names


def load_eval_sets(task: str | None, dataset: str | None, benchmarks: Sequence[str], n: int, seed: int,
                   fields: Fields = Fields(), cache_dir: str | None = None) -> list[tuple[str, list[Problem]]]:
    """The problems of a run's evaluation: [("", n problems of the eval split)], or with benchmark files
    [(name, the first n problems of each file)]; [] when n is 0."""
    if not n:
        return []
    if benchmarks:
        return [(name, load_benchmark(path, fields, cache_dir)[:n])
                for name, path in zip(benchmark_names(benchmarks), benchmarks, strict=True)]
    return [("", list(load_problems(task, dataset, "eval", n, seed, fields, cache_dir)))]

