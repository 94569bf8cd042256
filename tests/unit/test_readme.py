"""README.md stays a README for users: short, and every command and link in it true.

Every command in a README code block (all but ```text blocks) names files that exist and flags that exist:
a `bash X` script is a file of the repo; `python X.py ...` and `python -m module ...` (also under torchrun)
are files or modules of the repo, and every `--flag` given to them appears in their own `--help`.
Every relative link of the README and of docs/ resolves to a file (and heading); docs/development.md lists
every benchmark."""

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_LINES = 300
FILE_SUFFIXES = (".py", ".sh", ".toml", ".yaml", ".yml", ".md", ".png", ".json")
SEPARATORS = {"&", "&&", "|", "||", ";"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


def _code_blocks(text: str) -> list[str]:
    """Every fenced block but the ```text ones (drawings, sample output): those hold commands."""
    return [body for lang, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S) if lang != "text"]


def _commands(block: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at & && | ; ."""
    out: list[list[str]] = []
    for line in block.replace("\\\n", " ").splitlines():
        cmd: list[str] = []
        for w in shlex.split(line, comments=True):
            if w in SEPARATORS:
                out.append(cmd)
                cmd = []
            elif w.endswith((";", "&")):
                out.append([*cmd, w.rstrip(";&")])
                cmd = []
            else:
                cmd.append(w)
        out.append(cmd)
    return [c for c in out if c]


@functools.cache
def _tracked_top_level() -> frozenset[str]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return frozenset(n.split("/", 1)[0] for n in names.splitlines())


def _repo_path(word: str) -> Path | None:
    """The repo file a word names, if it names one: a relative path under a tracked top-level entry, or a
    relative name with a file suffix. Absolute paths, URLs, variables and placeholders are the user's."""
    word = word.split("=", 1)[1] if word.startswith("-") and "=" in word else word
    if not word or word.startswith(("-", "/", "$", "<", "~", "http:", "https:", "'", '"', ".venv/")) or "(" in word:
        return None
    if "[" in word or "*" in word or ":" in word or "," in word:
        return None
    word = word.removeprefix("./")
    under_tracked = "/" in word and word.split("/", 1)[0] in _tracked_top_level()
    return ROOT / word if under_tracked or word.endswith(FILE_SUFFIXES) else None


def _module_path(module: str) -> Path | None:
    base = ROOT / Path(*module.split("."))
    for p in (base / "__main__.py", base.with_suffix(".py")):
        if p.is_file():
            return p
    return None


@functools.cache
def _help(target: tuple[str, ...]) -> str:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, *target, "--help"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, f"{' '.join(target)} --help failed: {done.stderr[-2000:]}"
    return done.stdout


def _program(cmd: list[str]) -> tuple[tuple[str, ...], list[str]] | None:
    """(python target, its arguments) when the command runs a repo script or module, else None."""
    words = list(cmd)
    while words and ENV_ASSIGNMENT.match(words[0]):
        words.pop(0)
    if not words:
        return None
    exe = Path(words[0]).name
    if exe == "torchrun" or (exe.startswith("python") and words[1:3] in (["-m", "torch.distributed.run"],
                                                                         ["-m", "forkrl.launch"])):
        if "-m" not in words[1:] or words.index("-m") + 1 >= len(words):
            return None
        i = len(words) - 1 - words[::-1].index("-m")
        return ("-m", words[i + 1]), words[i + 2:]
    if not exe.startswith("python") or len(words) < 2:
        return None
    if words[1] == "-m":
        return ("-m", words[2]), words[3:]
    if words[1].endswith(".py"):
        return (words[1],), words[2:]
    return None


def _readme_commands() -> list[list[str]]:
    return [c for b in _code_blocks(README.read_text()) for c in _commands(b)]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines, more than {MAX_LINES}: move reference material to docs/"


def test_readme_has_commands_to_check():
    commands = _readme_commands()
    assert any(c[:2] == ["bash", "scripts/demo.sh"] for c in commands)
    assert any(c[:2] == ["bash", "scripts/test.sh"] for c in commands)
    assert any(_program(c) == (("clients/start_run.py",), c[2:]) for c in commands if len(c) > 2)


def test_every_file_a_readme_command_names_exists():
    missing = []
    for cmd in _readme_commands():
        words = [w for w in cmd if w != "sudo"]
        while words and ENV_ASSIGNMENT.match(words[0]):
            words.pop(0)
        if words and words[0] in ("bash", "sh") and len(words) > 1 and not (ROOT / words[1]).is_file():
            missing.append((" ".join(cmd), words[1]))
        for w in cmd:
            p = _repo_path(w)
            if p is not None and not p.exists():
                missing.append((" ".join(cmd), w))
    assert not missing, f"README commands name files that do not exist: {missing}"


def test_every_script_module_and_flag_of_a_readme_command_exists():
    checked, problems = 0, []
    for cmd in _readme_commands():
        prog = _program(cmd)
        if prog is None:
            continue
        target, args = prog
        if target[0] == "-m":
            if _module_path(target[1]) is None:
                problems.append((" ".join(cmd), f"no module {target[1]} in the repo"))
                continue
        elif not (ROOT / target[0]).is_file():
            problems.append((" ".join(cmd), f"no file {target[0]}"))
            continue
        text = _help(target)
        for flag in (a.split("=", 1)[0] for a in args if a.startswith("--")):
            checked += 1
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text):
                problems.append((" ".join(cmd), f"{flag} is not in `{' '.join(target)} --help`"))
    assert not problems, f"README commands use what does not exist: {problems}"
    assert checked >= 10  # the parser found the flags (a parser that finds none would pass vacuously)


def _anchors(doc: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    heads = re.findall(r"^#+ (.*)$", re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.M | re.S), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def _broken_links(doc: Path) -> list[str]:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"^[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (doc.parent / path) if path else doc
        if not target.exists() or (anchor and target.suffix == ".md" and anchor not in _anchors(target)):
            broken.append(link)
    return broken


def test_every_relative_link_in_the_readme_resolves():
    assert len(re.findall(r"\]\((?![a-z]+:)[^)\s]+\)", README.read_text())) >= 10  # the links were found
    broken = _broken_links(README)
    assert not broken, f"README links to files or headings that do not exist: {broken}"


def test_the_docs_link_only_to_files_and_headings_that_exist():
    broken = {doc.name: b for doc in sorted((ROOT / "docs").glob("*.md")) if (b := _broken_links(doc))}
    assert not broken, f"docs link to files or headings that do not exist: {broken}"


def test_development_doc_lists_every_benchmark():
    text = (ROOT / "docs" / "development.md").read_text()
    missing = [p.name for p in sorted((ROOT / "bench").glob("bench_*.py")) if f"`bench/{p.name}`" not in text]
    assert not missing, f"docs/development.md does not list {missing}"
