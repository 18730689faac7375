"""The parameter lists of the kernels, read from their `extern "C"` declarations in kernels/*.cu.

A kernel's parameters are declared once, in its `.cu` file. A launcher passes them by name
(`LaunchSpec.args`, in order) and tests/test_kernel_signatures.py checks every launcher's names
and kinds against what this module reads from the file, as `mirrored()` does for constants: a
launcher that passes its arguments in another order, or a kernel that gains, loses or renames a
parameter, fails on the CPU before any launch could hand a kernel the wrong bytes.

    KernelParam        one parameter: its name, its C type, its kind
    kernel_signatures  every `extern "C" __global__` kernel of a file's text → KernelSignature,
                       those a macro instantiates included (`ATTENTION_PREFILL_KERNEL(name, 64)`)
    arg_kind           the kind of an argument a launcher passes, to compare with a parameter's

Kinds: "pointer" (any `T*`), "int32", "uint32", "uint64", "float32", "tensor map" (a
`__grid_constant__` CUtensorMap passed by value). The file is read the way the C preprocessor
starts: backslash-newlines spliced, comments removed; macros are expanded only where a kernel is
defined inside one (a token substitution of its parameters, `##` pasted).
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import dataclass

from .base import BufferSpec, TensorMapSpec

# extern "C" __global__ void [__launch_bounds__(...)] [__cluster_dims__(...)] NAME(PARAMS) {
# (NAME may hold `##`)
_KERNEL_RE = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^()]*\)\s*)?'
                        r'(?:__cluster_dims__\s*\([^()]*\)\s*)?'
                        r'([A-Za-z_][\w#]*)\s*\(([^()]*)\)\s*\{')
_DEFINE_RE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)\(([^)]*)\)", re.MULTILINE)
# Words of a parameter's type that do not change what is passed.
_QUALIFIERS = {"const", "volatile", "__restrict__", "__grid_constant__"}
_SCALAR_KINDS = {"int": "int32", "unsigned int": "uint32", "unsigned": "uint32", "u32": "uint32",
                 "float": "float32", "u64": "uint64", "unsigned long long": "uint64"}
_CTYPES_KINDS = {ctypes.c_int32: "int32", ctypes.c_uint32: "uint32", ctypes.c_uint64: "uint64",
                 ctypes.c_float: "float32"}


@dataclass(frozen=True)
class KernelParam:
    """One kernel parameter as declared: `const __half* __restrict__ q` → ("q", "const __half*
    __restrict__", "pointer")."""

    name: str
    ctype: str
    kind: str


@dataclass(frozen=True)
class KernelSignature:
    """One kernel of a file.

    Attributes:
        kernel: its name (a macro-instantiated kernel: the name after expansion).
        params: its parameters in order.
        declaration: the declaration as written, up to the body; for a kernel a macro
            instantiates, the macro's head, "...", and the line that instantiates it.
    """

    kernel: str
    params: tuple[KernelParam, ...]
    declaration: str


def param_kind(ctype: str) -> str:
    """The kind of a parameter of C type `ctype` (module doc).

    Raises:
        ValueError: a type drvqwen's kernels do not take (a launcher could not pass it).
    """
    if "*" in ctype:
        return "pointer"
    words = " ".join(w for w in ctype.split() if w not in _QUALIFIERS)
    if words.lower().endswith("tensormap"):         # CUtensorMap, or a struct of its 128 bytes
        return "tensor map"
    if words in _SCALAR_KINDS:
        return _SCALAR_KINDS[words]
    raise ValueError(f"kernel parameter type {ctype!r}: no launcher argument kind for it")


def arg_kind(value) -> str:
    """The kind of a launcher's argument: a planned or real buffer (or a null pointer) is a
    "pointer", a planned or encoded tensor map a "tensor map", a ctypes scalar its type's kind.

    Raises:
        TypeError: anything else (KernelLaunch would refuse it too).
    """
    if isinstance(value, TensorMapSpec) or callable(getattr(value, "raw_bytes", None)):
        return "tensor map"
    if isinstance(value, BufferSpec) or isinstance(getattr(value, "ptr", None), int):
        return "pointer"
    if type(value) in _CTYPES_KINDS:
        return _CTYPES_KINDS[type(value)]
    raise TypeError(f"{type(value).__name__} is not a kernel argument")


def _params(text: str) -> tuple[KernelParam, ...]:
    out = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece or piece == "void":
            continue
        m = re.fullmatch(r"(.*?)(\w+)", piece, re.DOTALL)
        if m is None or not m.group(1).strip():
            raise ValueError(f"kernel parameter {piece!r}: no type and name")
        ctype = " ".join(m.group(1).split())
        out.append(KernelParam(m.group(2), ctype, param_kind(ctype)))
    return tuple(out)


def _preprocess(text: str) -> str:
    """Backslash-newlines spliced, then comments removed (translation phases 2 and 3; kernel
    files hold no string with // or /* in it)."""
    text = text.replace("\\\n", " ")
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def _substitute(text: str, params: list[str], args: list[str]) -> str:
    for p, a in zip(params, args):
        text = re.sub(rf"\b{re.escape(p)}\b", a, text)
    return re.sub(r"\s*##\s*", "", text)


def _line_of(text: str, pos: int) -> str:
    start = text.rfind("\n", 0, pos) + 1
    end = text.find("\n", pos)
    return text[start:end if end >= 0 else len(text)]


def kernel_signatures(text: str) -> dict[str, KernelSignature]:
    """Every `extern "C" __global__` kernel of a kernel file's source text, by name.

    Raises:
        ValueError: a declaration this reader cannot take apart (every `extern "C"` of the file
            must be a kernel it finds), a macro-defined kernel that is never instantiated, or a
            parameter type no launcher could pass.
    """
    src = _preprocess(text)
    found: dict[str, KernelSignature] = {}
    matches = list(_KERNEL_RE.finditer(src))
    n_extern = len(re.findall(r'extern\s+"C"', src))
    if len(matches) != n_extern:
        raise ValueError(f'{n_extern} extern "C" declarations, {len(matches)} of them readable as kernels')
    for m in matches:
        define = _DEFINE_RE.match(_line_of(src, m.start()))
        if define is None:
            decl = _declaration(text, m.group(1))
            found[m.group(1)] = KernelSignature(m.group(1), _params(m.group(2)), decl)
            continue
        macro, macro_params = define.group(1), [p.strip() for p in define.group(2).split(",")]
        uses = [u for u in re.finditer(rf"^[ \t]*{macro}\s*\(([^()]*)\)", src, re.MULTILINE)
                if _DEFINE_RE.match(_line_of(src, u.start())) is None]
        if not uses:
            raise ValueError(f"kernel {m.group(1)} of macro {macro} is never instantiated")
        head = _macro_head(text, macro)
        for u in uses:
            args = [a.strip() for a in u.group(1).split(",")]
            name = _substitute(m.group(1), macro_params, args)
            found[name] = KernelSignature(name, _params(_substitute(m.group(2), macro_params, args)),
                                          f"{head}\n...\n{u.group(0).strip()}")
    return found


def _declaration(raw: str, kernel: str) -> str:
    """The lines of `raw` from the `__global__` line that declares `kernel` up to its body."""
    for m in re.finditer(r"__global__", raw):
        start = raw.rfind("\n", 0, m.start()) + 1
        body = raw.find("{", m.end())
        decl = raw[start:body]
        if re.search(rf"\b{re.escape(kernel)}\s*\(", decl):
            return decl.rstrip()
    return kernel


def _macro_head(raw: str, macro: str) -> str:
    """The `#define MACRO(...)` of `raw` up to the body of the kernel it defines."""
    d = re.search(rf"#\s*define\s+{macro}\(", raw)
    if d is None:
        return f"#define {macro}(...)"
    return raw[d.start():raw.find("{", d.end())].rstrip()


def declaration(text: str, kernel: str) -> str | None:
    """The declaration of `kernel` in a kernel file's text as written (KernelSignature.declaration),
    or None where the file defines no such kernel (or cannot be read as kernels)."""
    try:
        sig = kernel_signatures(text).get(kernel)
    except ValueError:
        return None
    return None if sig is None else sig.declaration
