"""Every `self.name(...)` call in drvqwen's own classes names a method or attribute the class (or a
base class of drvqwen's) defines.

Why a static check: much of the runtime (the GPU prefill, the decode step's plans) is built only
on a GPU, so a method deleted while a caller still names it passes every CPU test and fails on
the first GPU run. The AST sees every call site whatever machine reads it.

A class with a base from outside drvqwen (an exception, a Protocol, a library class) is skipped:
what it inherits is not in these files. Mixins, which call methods of the class they are mixed
into, are listed with those methods in MIXIN_NEEDS.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "drvqwen"

# A mixin's calls to methods its host class supplies (the host's contract, said in its docstring).
MIXIN_NEEDS = {"DecodeVerify": {"decode"}}


def _classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    out: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append((path, node))
    return out


def _defined(cls: ast.ClassDef) -> set[str]:
    """Names the class body defines: methods, class attributes, and `self.x = …` anywhere in it."""
    names: set[str] = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _base_names(cls: ast.ClassDef) -> list[str | None]:
    """Each base as a plain class name, None where it is not one (a subscript, a call)."""
    out = []
    for b in cls.bases:
        out.append(b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else None)
    return out


def test_self_calls_name_what_the_class_defines():
    classes = _classes()
    problems = []
    for name, defs in classes.items():
        for path, cls in defs:
            seen, todo, known, outside = set(), [cls], set(MIXIN_NEEDS.get(name, ())), False
            while todo:
                c = todo.pop()
                if id(c) in seen:
                    continue
                seen.add(id(c))
                known |= _defined(c)
                for b in _base_names(c):
                    if b is None or b not in classes or len(classes[b]) != 1:
                        outside = True   # a base from outside drvqwen (or ambiguous): cannot tell
                    else:
                        todo.append(classes[b][0][1])
            if outside:
                continue
            for node in ast.walk(cls):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "self" \
                        and node.func.attr not in known:
                    problems.append(f"{path.relative_to(SRC.parents[1])}:{node.lineno}: {name} calls "
                                    f"self.{node.func.attr}(), which it does not define")
    assert not problems, "\n".join(problems)


def test_the_check_finds_a_missing_method(tmp_path, monkeypatch):
    """The check itself: a class calling a method it lacks is reported (so it cannot pass empty)."""
    pkg = tmp_path / "src" / "drvqwen"
    pkg.mkdir(parents=True)
    (pkg / "m.py").write_text("class A:\n    def run(self):\n        return self.plan()\n")
    monkeypatch.setattr(__import__(__name__), "SRC", pkg)
    try:
        test_self_calls_name_what_the_class_defines()
    except AssertionError as e:
        assert "A calls self.plan()" in str(e)
    else:
        raise AssertionError("a missing method went unreported")
