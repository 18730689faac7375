"""Edit prompts: a Python function and an instruction to change it, as the user turn of the chat
template. Most of the answer is the function again, the case prompt lookup is made for
(docs/speculative.md). `drvqwen bench --lookup/--draft` asks `edit_prompt(tok, EXAMPLE_FUNCTION)`;
tools/bench_edit.py asks every instruction of HumanEval's canonical solutions.
"""

from __future__ import annotations

EDIT_INSTRUCTIONS = {
    "type hints": "Add type hints to this Python function. Change nothing else. Answer with the whole "
                  "function in one ```python code block.",
    "rename parameters": "Rename the parameters of this Python function to clearer names, everywhere they "
                         "are used. Change nothing else. Answer with the whole function in one ```python "
                         "code block.",
    "docstring": "Add a docstring to this Python function (replace the one it has, if any). Change nothing "
                 "else. Answer with the whole function in one ```python code block.",
}

# The function `drvqwen bench` asks to edit: ordinary code without type hints, long enough that
# the answer (the function again, annotated) is a few hundred tokens.
EXAMPLE_FUNCTION = '''\
def summarize_scores(records, key="score", top=3, skip_missing=True):
    totals = {}
    counts = {}
    for record in records:
        name = record.get("name")
        if name is None:
            continue
        value = record.get(key)
        if value is None:
            if skip_missing:
                continue
            value = 0.0
        totals[name] = totals.get(name, 0.0) + float(value)
        counts[name] = counts.get(name, 0) + 1
    means = {name: totals[name] / counts[name] for name in totals}
    ranked = sorted(means.items(), key=lambda item: (-item[1], item[0]))
    lines = []
    for rank, (name, mean) in enumerate(ranked[:top], 1):
        lines.append(f"{rank}. {name}: {mean:.2f} over {counts[name]} records")
    return "\\n".join(lines), means
'''


def edit_prompt(tok, code: str, instruction: str = "type hints") -> list[int]:
    """Ids of the chat-template user turn asking to edit `code` (text ending in a newline).

    Args:
        tok: a tokenizer.Tokenizer with the chat template's control tokens.
        code: the Python source to edit.
        instruction: a key of EDIT_INSTRUCTIONS.
    Raises:
        KeyError: an unknown instruction.
        DrvqwenError: the tokenizer lacks the chat template's control tokens (Tokenizer.chat).
    """
    return tok.chat(f"{EDIT_INSTRUCTIONS[instruction]}\n\n```python\n{code}```\n")
