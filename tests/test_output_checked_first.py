"""A file a command is told to write is checked before the work it holds the result of: its
folder must exist and take files, and it must not be a folder. Otherwise the command ends with
one line naming it, before a model is opened or a source read (a conversion of the real 0.5B
took ~7 s, a HumanEval run minutes, before failing to write the result).

Each command's work is replaced by a function that fails the test if it is reached.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("private_cache")


@pytest.fixture
def no_work(monkeypatch):
    """Make opening a model or a conversion source fail the test."""
    import drvqwen.format.convert as convert
    import drvqwen.humaneval as he
    import drvqwen.loading as loading

    def reached(*a, **k):
        raise AssertionError("the work started before the output was checked")

    for module, name in ((loading, "open_model"), (convert, "open_source"), (he, "load_problems")):
        monkeypatch.setattr(module, name, reached)


def _one_error_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize("argv", [
    ["convert", "SOURCE", "-o", "{out}"],
    ["convert", "SOURCE", "-o", "{ok}", "--report-json", "{out}"],
    ["run", "--device", "cpu", "-p", "hi", "--json-stats", "{out}"],
    ["eval", "humaneval", "--problems", "P.jsonl", "--json", "{out}"],
    ["eval", "agree", "--reference", "R.gguf", "--json", "{out}"],
], ids=["convert-o", "convert-report-json", "run-json-stats", "eval-humaneval-json", "eval-agree-json"])
def test_a_missing_output_folder_is_named_before_the_work(tmp_path, capsys, no_work, argv):
    from drvqwen.cli import main

    out = tmp_path / "missing" / "dir" / "result"
    argv = [a.format(out=out, ok=tmp_path / "ok.nanoqwen") for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: {out.parent}: cannot write") and "No such file or directory" in line


def test_a_folder_given_as_the_output_is_refused_first(tmp_path, capsys, no_work):
    from drvqwen.cli import main

    assert main(["run", "--device", "cpu", "-p", "hi", "--json-stats", str(tmp_path)]) == 2
    assert _one_error_line(capsys) == f"error: {tmp_path}: is a directory; give the output file name"


@pytest.mark.parametrize("argv, role", [
    (["run", "--device", "cpu", "--model", "{inp}", "-p", "hi", "--json-stats", "{inp}"], "the model"),
    (["run", "--device", "cpu", "-f", "{inp}", "--json-stats", "{inp}"], "the prompt file"),
    (["convert", "{inp}", "-o", "{ok}", "--report-json", "{inp}"], "the source"),
    (["convert", "SOURCE", "-o", "{ok}", "--report-json", "{ok}"], None),
    (["eval", "humaneval", "--problems", "{inp}", "--json", "{inp}"], "the problems file"),
    (["eval", "agree", "--reference", "{inp}", "--json", "{inp}"], "the reference"),
], ids=["run-model", "run-prompt-file", "convert-source", "convert-output", "humaneval-problems", "agree-reference"])
def test_an_output_that_is_an_input_is_refused_first(tmp_path, capsys, no_work, argv, role):
    """`--json-stats model.nanoqwen` replaced the model with 676 bytes of JSON after the run."""
    from drvqwen.cli import main

    inp = tmp_path / "input.bin"
    inp.write_bytes(b"the input")
    argv = [a.format(inp=inp, ok=tmp_path / "ok.nanoqwen") for a in argv]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    if role is None:
        assert "is the converted model's file too" in line, line
    else:
        assert line.startswith(f"error: {inp}: is {role}, which this command reads"), line
    assert inp.read_bytes() == b"the input"


def test_json_files_take_the_users_permissions(tmp_path):
    """--json-stats and chat's /save write as `eval --json` does: 0666 less the umask, not the
    0600 of a private temporary file; a folder that is not there is one line naming the file."""
    import os
    import stat

    from drvqwen.errors import DrvqwenError
    from drvqwen.paths import atomic_write_bytes
    from drvqwen.stats import write_json_atomic

    old = os.umask(0o022)
    try:
        write_json_atomic(tmp_path / "stats.json", {"a": 1})
        atomic_write_bytes(tmp_path / "eval.json", b"{}")
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE((tmp_path / n).stat().st_mode) for n in ("stats.json", "eval.json")}
    assert modes == {"stats.json": 0o644, "eval.json": 0o644}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval.json", "stats.json"]
    with pytest.raises(DrvqwenError, match="nowhere: cannot write the conversation there"):
        write_json_atomic(tmp_path / "nowhere" / "s.json", {}, "the conversation")


@pytest.mark.parametrize("name", [".", "/", "folder"])
def test_chat_save_to_a_folder_is_one_line(tmp_path, monkeypatch, name):
    """/save naming a folder (or `.`, `/`, which have no file name) is one line naming it; the
    chat goes on."""
    from drvqwen.errors import DrvqwenError
    from drvqwen.stats import write_json_atomic

    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(DrvqwenError, match="is a directory; give the output file name"):
        write_json_atomic(name, {"messages": []}, "the conversation")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


@pytest.mark.parametrize("writer", ["atomic_write_bytes", "write_json_atomic"])
def test_a_link_at_the_temporary_name_is_not_followed(tmp_path, writer):
    """A symlink planted at `.<name>.<pid>.tmp` (or a leftover of this pid) does not send the
    write through it: the target stays as it was and the output is written whole."""
    import os

    from drvqwen.paths import atomic_write_bytes
    from drvqwen.stats import write_json_atomic

    target = tmp_path / "victim.txt"
    target.write_text("keep me\n")
    out = tmp_path / "out.json"
    (tmp_path / f".out.json.{os.getpid()}.tmp").symlink_to(target)
    if writer == "atomic_write_bytes":
        atomic_write_bytes(out, b'{"a": 1}\n')
    else:
        write_json_atomic(out, {"a": 1})
    assert target.read_text() == "keep me\n"
    assert out.read_text().replace(" ", "").replace("\n", "") == '{"a":1}'
    assert not (tmp_path / f".out.json.{os.getpid()}.tmp").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json", "victim.txt"]
