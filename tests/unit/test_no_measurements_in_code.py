"""No measured number in a docstring or comment of the product (style.md): measurements go to docs/results.md
with their date, commit and machine, where they can be re-measured instead of rotting in code. Settings and
constants (a 4 MiB chunk, a 300 s timeout) are fine; what is caught is a number stated as an outcome: "measured
... 12", "took 3 s", "2x faster", "~10-20 s", "850 tok/s"."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOPS = ("forkrl", "rollout_service", "trainer_service", "probe_service", "serving", "clients", "scripts", "bench")
_NUM = r"(?<![\w.])\d+(?:\.\d+)?"
_UNIT = r"(?:ms|s|sec|seconds|min|minutes|h|hours|KB|MB|GB|KiB|MiB|GiB)\b"
PATTERNS = {
    "a measured number": re.compile(rf"\b(?:measured|took)\b[^.;:\n]{{0,60}}?{_NUM}", re.I),
    "a speed-up": re.compile(rf"{_NUM}\s?[x×]\s+(?:faster|slower|cheaper|quicker)\b"
                             rf"|\b(?:faster|slower|speed-?up)\b[^.;\n]{{0,30}}?{_NUM}\s?[x×](?!\w)"
                             rf"|{_NUM}\s?[-–]\s?\d+(?:\.\d+)?\s?[x×](?!\w)"  # a range of ratios: 10-20x
                             rf"|\binstead of ~?{_NUM}\s?{_UNIT}", re.I),
    "an approximate amount of time or memory": re.compile(rf"~\s?{_NUM}(?:\s?[-–]\s?\d+(?:\.\d+)?)?\s?{_UNIT}"),
    "a rate": re.compile(rf"{_NUM}\s?(?:tok/s|tokens/s|it/s|samples/s|steps/s|pos/s|records/s)"),
}


def _texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every docstring (any string statement: module, class, function, attribute) and comment."""
    source = path.read_text()
    out = [(node.lineno, node.value.value) for node in ast.walk(ast.parse(source))
           if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    out += [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT]
    return out


def measurements(path: Path) -> list[str]:
    """Each docstring or comment passage of `path` that states a measured number, with its line and kind."""
    found = []
    for line, text in _texts(path):
        for kind, pattern in PATTERNS.items():
            for m in pattern.finditer(text):
                found.append(f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:"
                             f"{line + text[:m.start()].count(chr(10))}: {kind}: {m.group(0)!r}")
    return found


def _product() -> list[Path]:
    return sorted(p for t in TOPS for p in (ROOT / t).rglob("*.py")
                  if "__pycache__" not in p.parts and "wire" not in p.relative_to(ROOT).parts[:2])


def test_no_docstring_or_comment_carries_a_measured_number() -> None:
    found = [hit for path in _product() for hit in measurements(path)]
    assert not found, ("measured numbers in docstrings/comments (move them to docs/results.md with date, commit "
                       "and machine; say in the code what it does and guarantees):\n" + "\n".join(found))


@pytest.mark.parametrize("text,caught", [
    ("start (measured 2x slower than one row)", True),
    ("the benchmark took 3.5 s here", True),
    ("bfloat16 is ~4x faster on CPU", True),
    ("starts 5x slower", True),
    ("a speed-up of 2.5x", True),
    ("the engine starts in ~10-20 s on CPU", True),
    ("a pass over memory (~0.3 s per 400 MB)", True),
    ("vLLM samples 850 tok/s", True),
    ("~0.6 GB less RSS", True),
    ("they slow each other 10-20x", True),
    ("a 2-3 s start instead of 15 s", True),
    # settings, constants and arithmetic: fine
    ("chunks of at most 4 MiB (gRPC's default limit)", False),
    ("timeout_s: 300 s without a push ends the session", False),
    ("records the config, its hash, the measured accuracy, the time and the sha256", False),
    ("bench/bench_memory.py checks them against a measured CPU step. Trainer, per rank of W: fp32 weights", False),
    ("107 M parameters (0.43 GB of fp32 weights)", False),
    ("the 95% interval over 1000 resamples", False),
    ("prints the ratio 2 ranks / 1 rank (< 1 means 2 ranks are faster)", False),
    ("sleeps 20 ms (a constant of vLLM's)", False),
])
def test_the_patterns_catch_outcomes_and_leave_settings(tmp_path: Path, text: str, caught: bool) -> None:
    f = tmp_path / "m.py"
    f.write_text(f'"""{text}"""\n\nX = 1  # {text}\n')
    lines = {hit.split(":")[1] for hit in measurements(f)}
    assert lines == ({"1", "3"} if caught else set()), measurements(f)  # the docstring and the comment alike
