"""Every figure README and docs quote is traced to a committed run of the code it describes.

A quoted figure is a number followed by a link to its run's JSON whose title names the field:

    | 7B decode ITL, graph | 2.107 ms [↗](docs/bench/FILE.json "modes.graph.itl_median_ms") | ≤ 1.3 ms |

Checked here, on the CPU:
- the number equals the field's value rounded to the digits quoted (the field may be a dotted
  path through dicts and lists: `modes.graph.itl_median_ms`, `us.persistent.qkv_proj`; a number
  followed by `%` quotes a fraction as a percentage);
- the JSON names the code that produced it (`source.commit`, `source.digest`, written by
  drvqwen.provenance), the commit is a real one without local edits, and the digest recomputed
  from that commit's tree matches — so a figure cannot claim code that did not produce it;
- README's "Where it stands" table quotes no figure without such a link.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from drvqwen.provenance import digest_of_commit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# A number (with its sign and decimals), optional unit words, then a link to a bench JSON with a title.
TRACE = re.compile(r'(?<![\w.])(-?\d[\d,]*(?:\.\d+)?)\s*((?:[^\s\[\]()|]*\s*){0,2})\[[^\]]*\]\(((?:\.\./|\./)?(?:docs/)?bench/[^)\s]+\.json)\s+"([^"]+)"\)')
FIGURE = re.compile(r'\d(?:[\d,]*)(?:\.\d+)?\s*(?:ms|µs|s|tok/s|TFLOP/s|GB/s|%)(?![\w/])')


def traces() -> list[tuple[Path, int, str, Path, str]]:
    """(doc, line number, quoted number, JSON path, field) for every traced figure in the docs."""
    out = []
    for doc in DOCS:
        for n, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for m in TRACE.finditer(line):
                target = (doc.parent / m.group(3)).resolve()
                quoted = m.group(1) + ("%" if "%" in m.group(2) else "")
                out.append((doc, n, quoted, target, m.group(4)))
    return out


def field(data, path: str):
    """The value at a dotted path; a key that holds dots itself (a step name such as
    "attention.0") is matched whole, the shortest such key first."""
    parts = path.split(".")
    while parts:
        if isinstance(data, list):
            data = data[int(parts.pop(0))]
            continue
        for n in range(1, len(parts) + 1):
            key = ".".join(parts[:n])
            if key in data:
                data, parts = data[key], parts[n:]
                break
        else:
            raise KeyError(path)
    return data


TRACES = traces()


def test_readme_quotes_traced_figures():
    assert any(doc.name == "README.md" for doc, *_ in TRACES), "README quotes no traced figure"


@pytest.mark.parametrize("doc,line,quoted,target,path", TRACES,
                         ids=[f"{d.name}:{n}:{p}" for d, n, _, _, p in TRACES])
def test_traced_figure_matches_its_run(doc, line, quoted, target, path):
    where = f"{doc.relative_to(ROOT)}:{line}"
    assert target.is_file(), f"{where}: no such run {target.relative_to(ROOT)}"
    data = json.loads(target.read_text(encoding="utf-8"))
    value = float(field(data, path))
    if quoted.endswith("%"):  # a fraction quoted as a percentage
        value, quoted = value * 100, quoted[:-1]
    q = quoted.replace(",", "")
    digits = len(q.split(".")[1]) if "." in q else 0
    assert round(value, digits) == float(q), f"{where}: quotes {quoted}, {target.name} {path} = {value}"


@pytest.mark.parametrize("target", sorted({t for *_, t, _ in TRACES}), ids=lambda p: p.name)
def test_quoted_run_names_the_committed_code_that_made_it(target):
    data = json.loads(target.read_text(encoding="utf-8"))
    source = data.get("source") or {}
    commit, digest = source.get("commit"), source.get("digest")
    assert commit and digest, f"{target.name}: no source.commit / source.digest (drvqwen.provenance)"
    assert not commit.endswith("+dirty"), f"{target.name}: measured on uncommitted code ({commit})"
    shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                             capture_output=True, text=True).stdout.strip() == "true"
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{commit}^{{commit}}"]).returncode == 0
    if not known and shallow:
        pytest.skip(f"{target.name}: commit {commit[:12]} is not in this shallow clone's history")
    assert known, f"{target.name}: commit {commit} is not in this repository's history"
    assert digest_of_commit(commit, ROOT) == digest, (
        f"{target.name}: the runtime files of {commit[:12]} do not hash to the digest the run recorded")


def test_where_it_stands_quotes_only_traced_figures():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = text.split("### Where it stands", 1)[1].split("\n\n", 2)[1]
    rows = [r for r in section.splitlines() if r.startswith("|") and not set(r) <= set("|-: ")][1:]
    assert rows, "README's Where it stands table is empty"
    for row in rows:
        measured = row.split("|")[2]  # the drvqwen column
        figures = FIGURE.findall(measured)
        traced = TRACE.findall(measured)
        assert figures and len(traced) == len(figures), f"untraced figure in README: {row.strip()}"


def test_field_follows_keys_that_hold_dots():
    """A role named after its step ("attention.0") is one key, not two."""
    data = {"roles": {"attention.0": {"span_us": 3.5}, "o_proj": {"x": [1.0, 2.0]}}}
    assert field(data, "roles.attention.0.span_us") == 3.5
    assert field(data, "roles.o_proj.x.1") == 2.0
    with pytest.raises(KeyError):
        field(data, "roles.attention.1.span_us")
