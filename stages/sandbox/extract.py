"""Pull the gradable part out of a model's response: the last Python code block, or the final math answer.

Both are plain text functions with no sandbox involved, so the scoring of a response never depends on
which backend runs it.
"""

from __future__ import annotations

import re

# A fence opens with ``` and an optional info string on the same line; the block runs to the next fence on a line
# of its own (group 3: closed) or, for a response cut off by the token limit, to the end of the text.
_FENCE = re.compile(r"^[ \t]*```[ \t]*([^\n`]*)\n(.*?)(?:(^[ \t]*```[ \t]*$)|\Z)", re.DOTALL | re.MULTILINE)
_PYTHON_TAGS = {"python", "py", "python3", "py3"}


def extract_code(response_text: str) -> str | None:
    """The last complete ```python block of a markdown response, else the last untagged ``` block, else None.

    Complete: closed by its fence. A block the token limit cut off counts only where no complete block of its
    kind comes before it (an answer cut inside its only block is still graded): a solution followed by an
    "Example usage" block cut mid-line is graded on the solution, as the peers' extractors do (they take the
    last closed block). Blocks tagged with another language (```bash, ```text) never count: running shell
    text as Python would only turn a formatting slip into a syntax error. An empty block counts as no code.
    """
    python_blocks: list[tuple[str, bool]] = []
    plain_blocks: list[tuple[str, bool]] = []
    for match in _FENCE.finditer(response_text):
        tag = match.group(1).strip().lower().split(" ")[0] if match.group(1).strip() else ""
        block = (match.group(2), match.group(3) is not None)
        if tag in _PYTHON_TAGS:
            python_blocks.append(block)
        elif tag == "":
            plain_blocks.append(block)
    for blocks in (python_blocks, plain_blocks):
        complete = [body for body, closed in blocks if closed]
        body = complete[-1] if complete else blocks[-1][0] if blocks else ""
        if body.strip():
            return body.rstrip() + "\n"
    return None


_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)


def _last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, matching braces (answers like \\frac{1}{2} nest them)."""
    found: str | None = None
    for match in _BOXED.finditer(text):
        depth = 1
        position = match.end()
        while position < len(text) and depth:
            if text[position] == "{":
                depth += 1
            elif text[position] == "}":
                depth -= 1
            position += 1
        if depth == 0:
            found = text[match.end() : position - 1]
    return found


def extract_answer(response_text: str) -> str | None:
    """The final answer of a math response: the last \\boxed{...}, else the last <answer>...</answer>."""
    boxed = _last_boxed(response_text)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    tags = _ANSWER_TAG.findall(response_text)
    if tags and tags[-1].strip():
        inner = tags[-1].strip()
        # <answer>\boxed{5}</answer> is common; the box is the answer either way.
        return _last_boxed(inner) or inner
    return None


# A number as written in prose: an optional sign, digits with thousands commas, an optional decimal part.
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def last_number(response_text: str) -> str | None:
    """The last number of a response, commas dropped ("1,234.5" -> "1234.5"): verl's gsm8k `flexible` answer."""
    numbers = _NUMBER.findall(response_text)
    return numbers[-1].replace(",", "") if numbers else None
