"""Where a completion's answer is, as each reward reads it: the last `\\boxed{}` (math-verify), DAPO's last
"Answer:" line, or the built-in tasks' integer after the last "=". Pure string functions, no imports from the rest of
forkrl/data: rewards, prompts, datasets and tasks all read answers through this module.
"""

from __future__ import annotations

import re

ANSWER_LINE_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # DAPO's (verl math_dapo.py)
ANSWER_LINE_TAIL = 300  # DAPO looks at the last 300 characters only
_INTEGER_RE = re.compile(r"-?\d+")


def last_boxed_only_string(text: str) -> str | None:
    """The last `\\boxed{...}` (or `\\fbox{...}`) in `text`, braces matched, including the command; the
    `\\boxed 5` form without braces runs to the next `$` or whitespace. None when there is none or its
    braces do not close."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    command = "\\boxed" if text.startswith("\\boxed", idx) else "\\fbox"
    rest = text[idx + len(command) :]
    if rest.startswith(" "):
        value = rest.lstrip(" ").split("$", 1)[0].split()
        return f"{command} {value[0]}" if value else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return command + rest[: i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    """`\\boxed{x}` -> `x` (also `\\fbox{x}` and `\\boxed x`)."""
    for command in ("\\boxed", "\\fbox"):
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1 : -1]
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1 :]
    raise ValueError(f"not a boxed expression: {boxed!r}")


def answer_line(text: str) -> str | None:
    """DAPO's answer: the text after the last "Answer:" in the last 300 characters (to the end of its line),
    surrounding `$` and whitespace stripped; None when there is none."""
    found = ANSWER_LINE_RE.findall(text[-ANSWER_LINE_TAIL:])
    if not found:
        return None
    value = found[-1].strip().strip("$").strip()
    return value or None


def extract_answer(text: str) -> str | None:
    """The final answer in a completion: the integer after the last "=" (or the whole text when there is
    no "="), surrounding whitespace ignored. Anything else, including an empty answer, gives None."""
    tail = text.rsplit("=", 1)[-1].strip()
    return tail if _INTEGER_RE.fullmatch(tail) else None
