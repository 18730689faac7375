"""Text the user chose is shown as it is: paths, model and file names, chat messages and the
error messages that quote them never go through rich markup or emoji codes.

`[/x]` read as markup raises rich's MarkupError (a traceback instead of the one-line error, a
chat that dies on `/save`); `[bold]` read as markup vanishes from a path; `:smile:` becomes a
picture. Each command that prints such text is run with it; then the rule itself is checked
on the source: every console is console.make_console's and every progress label plain text.
"""

from __future__ import annotations

import ast
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("private_cache")

from helpers import TINY, byte_tokenizer_json, random_dense, write_model

SRC = Path(__file__).resolve().parent.parent / "src" / "drvqwen"
# Markup that rich refuses, markup that rich would swallow, and an emoji code.
HOSTILE = ("[/x]", "[bold]", ":smile:")


@pytest.fixture
def tiny(tmp_path, rng):
    path = tmp_path / "tiny.nanoqwen"
    write_model(path, TINY, random_dense(TINY, rng), tokenizer_json=byte_tokenizer_json())
    return path


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize("hostile", HOSTILE)
def test_an_error_quoting_a_path_is_one_line_as_typed(tmp_path, capsys, hostile):
    from drvqwen.cli import main

    missing = tmp_path / f"m{hostile}" / "model.nanoqwen"
    assert main(["run", "--model", str(missing), "--device", "cpu", "-p", "hi"]) == 2
    assert _lines(capsys.readouterr().err) == [f"error: {missing}: file not found"]


def test_info_shows_a_file_name_as_typed(tiny, tmp_path, capsys):
    from drvqwen.cli import main

    (tmp_path / "t[").mkdir()
    named = tmp_path / "t[" / "x][bold]:smile:.nanoqwen"       # the path holds "t[/x]"
    shutil.copy(tiny, named)
    assert main(["info", str(named)]) == 0
    out = capsys.readouterr().out
    assert named.name in out and str(named) in out


def test_list_shows_cache_names_as_typed(private_cache, capsys):
    from drvqwen.cli import main

    models = private_cache / "models"
    models.mkdir(parents=True, exist_ok=True)
    (models / "w[bold]:smile:.gguf").write_bytes(b"GGUF")     # a file name holds no "/"
    assert main(["list"]) == 0
    assert "w[bold]:smile:.gguf" in capsys.readouterr().out
    assert main(["rm", "w[bold]"]) == 0
    assert "removed w[bold]:smile:.gguf" in capsys.readouterr().err


def test_chat_save_and_commands_show_what_was_typed(tiny, tmp_path):
    """/save to a path holding `[/x]`, a /save that fails there, an unknown command in
    markup: the chat says each as typed and goes on."""
    folder = tmp_path / "[" / "x]"
    folder.mkdir(parents=True)
    save, bad = folder / "conv:smile:.json", folder / "none" / "conv.json"
    script = f"hello\n/save {save}\n/save {bad}\n/[bold]bogus\nagain\n"
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "drvqwen.cli", "chat", "-m", str(tiny), "--device", "cpu",
                        "-n", "4"], input=script, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"saved 3 messages to {save}" in r.stderr
    assert f"{bad.parent}: cannot write the conversation there" in r.stderr   # its folder is missing
    assert "unknown command /[bold]bogus" in r.stderr
    assert r.stderr.count("generated") == 2
    assert [m["role"] for m in json.loads(save.read_text())["messages"]] == ["system", "user", "assistant"]


def test_progress_labels_are_plain_text():
    from rich.console import Console

    from drvqwen.console import progress_bar

    for in_bytes in (False, True):
        buf = io.StringIO()
        with progress_bar(in_bytes=in_bytes, console=Console(file=buf, width=200)) as p:
            p.advance(p.add_task("model.layers.0[/x][bold]:smile:", total=1))
        assert "model.layers.0[/x][bold]:smile:" in buf.getvalue()


def test_a_transient_bar_leaves_nothing_in_a_file():
    """serve's and step's transient bars, written to a file or a pipe (no terminal to erase them
    on), are not shown: they left an empty line there; a lasting bar still writes its last state."""
    from rich.console import Console

    from drvqwen.console import progress_bar

    for transient, shown in ((True, ""), (False, "uploading")):
        buf = io.StringIO()
        console = Console(file=buf, width=200)
        console.print("before")
        with progress_bar(transient=transient, console=console) as p:
            p.advance(p.add_task("uploading", total=1))
        console.print("after")
        text = buf.getvalue()
        assert text.startswith("before\n") and text.endswith("after\n") and (shown in text)
        assert "\n\n" not in text, repr(text)


def _calls(name: str):
    for path in sorted(SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) == name:
                    yield path.relative_to(SRC), node


def test_every_console_and_progress_label_leaves_markup_alone():
    """The kind, on the source: consoles come from console.make_console (which reads no markup),
    progress labels are plain, and nothing renders markup by hand."""
    from drvqwen.console import make_console

    for stderr in (False, True):
        c = make_console(stderr=stderr)
        c.begin_capture()
        c.print("[/x] [bold]b :smile:")
        assert c.end_capture() == "[/x] [bold]b :smile:\n"
    consoles = [f"{p}:{n.lineno}" for p, n in _calls("Console") if str(p) != "console.py"]
    assert consoles == [], "make a console with console.make_console (markup and emoji off)"
    labels = [f"{p}:{n.lineno}" for p, n in _calls("TextColumn")
              if not any(k.arg == "markup" and isinstance(k.value, ast.Constant) and k.value.value is False
                         for k in n.keywords)]
    assert labels == [], "a TextColumn shows task descriptions (file and tensor names): markup=False"
    by_hand = [f"{p}:{n.lineno}" for name in ("from_markup", "render_markup") for p, n in _calls(name)]
    assert by_hand == []
