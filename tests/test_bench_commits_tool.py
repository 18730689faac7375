"""tools/bench_commits.py on the CPU: commits resolved or refused in one line, by git or by the
COMMIT files of trees prepared for a machine without the history (--prepare); a commit's tree
written by git archive with the files drvqwen.provenance hashes (its digest is the commit's); the
command each run gets; the synthetic file written once only where every tree writes the same."""

import importlib.util
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("bench_commits", ROOT / "tools" / "bench_commits.py")
bench_commits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_commits)

pytestmark = pytest.mark.skipif(not (ROOT / ".git").exists(), reason="not a git checkout")


def _head() -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_commits_resolve_to_full_hashes_or_exit_with_one_line():
    head = _head()
    assert bench_commits.resolve(["HEAD", head[:12], "."]) == [head, head, "."]
    with pytest.raises(SystemExit, match="--commits no-such-commit: not a commit"):
        bench_commits.resolve(["HEAD", "no-such-commit"])


def test_the_tree_is_the_commits_runtime_files(tmp_path):
    from drvqwen.provenance import digest_of_commit

    head = _head()
    tree = bench_commits.write_tree(head, tmp_path / "t")
    assert (tree / "src" / "drvqwen" / "bench.py").is_file() and (tree / "kernels" / "gemv_int4.cu").is_file()
    assert (tree / "pyproject.toml").is_file() and not (tree / "tests").exists()
    # The tree's own provenance module hashes it to the commit's digest: its runs' JSON can name it.
    got = subprocess.run(["python3", "-c", "from drvqwen.provenance import source_digest; print(source_digest())"],
                         env={"PYTHONPATH": str(tree / "src"), "PATH": "/usr/bin:/bin"}, capture_output=True,
                         text=True, check=True).stdout.strip()
    assert got == digest_of_commit(head, ROOT)


def test_each_run_is_told_its_commit(tmp_path):
    argv, env = bench_commits.bench_command(tmp_path, "a" * 40, "0.5b", "graph", tmp_path / "r.json",
                                            ["--new-tokens", "64"])
    assert argv[1:] == ["-m", "drvqwen.bench", "--preset", "0.5b", "--mode", "graph", "--json",
                        str(tmp_path / "r.json"), "--new-tokens", "64"]
    assert env["PYTHONPATH"] == str(tmp_path / "src") and env["DRVQWEN_SOURCE_COMMIT"] == "a" * 40
    _, env = bench_commits.bench_command(tmp_path, ".", "0.5b", "graph", tmp_path / "r.json", [])
    assert env.get("DRVQWEN_SOURCE_COMMIT") == __import__("os").environ.get("DRVQWEN_SOURCE_COMMIT")


def test_dry_run_prints_a_command_per_commit_and_round(capsys, tmp_path):
    assert bench_commits.main(["--commits", "HEAD", _head()[:10], ".", "--rounds", "2", "--dry-run",
                               "--out", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 6 and all("drvqwen.bench" in line for line in lines)
    assert [("DRVQWEN_SOURCE_COMMIT=" in line) for line in lines[:2]] == [True, True]
    assert f"cd {ROOT} " in lines[2]  # `.`: this tree itself, no archive
    with pytest.raises(SystemExit, match="--rounds 0"):
        bench_commits.main(["--commits", "HEAD", "--rounds", "0", "--dry-run"])


def test_a_failed_run_exits_with_one_line_naming_the_tree(monkeypatch, tmp_path):
    """drvqwen.bench failing in a tree (no GPU, a bad argument): one line with the tree, the round,
    the exit status and the run's last line — no traceback, nothing written as a result."""
    real_run = subprocess.run

    def run(cmd, **kw):
        if cmd[:3] == [bench_commits.sys.executable, "-m", "drvqwen.bench"]:
            return subprocess.CompletedProcess(cmd, 2, "", "error: drvqwen bench needs a Hopper GPU\n")
        return real_run(cmd, **kw)

    monkeypatch.setattr(bench_commits.subprocess, "run", run)
    import drvqwen.bench  # the synthetic file each run deletes first: a scratch one here

    monkeypatch.setattr(drvqwen.bench, "default_synthetic_path", lambda preset: tmp_path / f"syn_{preset}.nanoqwen")
    with pytest.raises(SystemExit, match=r"^[0-9a-f]{12} round 1: drvqwen.bench exited 2: error: drvqwen bench needs"):
        bench_commits.main(["--commits", "HEAD", "--rounds", "1", "--out", str(tmp_path)])
    assert not (tmp_path / "summary.json").exists()


def test_prepared_trees_resolve_without_git_and_refuse_in_one_line(tmp_path):
    """On a machine without the history (root is no repository), a commit is found by its hash
    prefix among the trees' COMMIT files; an unknown or ambiguous prefix is one line."""
    trees = tmp_path / "trees"
    for h in ("ab12" + "0" * 36, "ab34" + "0" * 36, "cd56" + "1" * 36):
        (trees / h[:12]).mkdir(parents=True)
        (trees / h[:12] / "COMMIT").write_text(h + "\n")
    nowhere = tmp_path / "not_a_repo"
    nowhere.mkdir()
    assert bench_commits.resolve(["ab12", "cd5", "."], root=nowhere, trees=trees) == \
        ["ab12" + "0" * 36, "cd56" + "1" * 36, "."]
    with pytest.raises(SystemExit, match=r"^--commits ab: not a commit .* nor a tree prepared in "):
        bench_commits.resolve(["ab"], root=nowhere, trees=trees)  # two trees start with it
    with pytest.raises(SystemExit, match=r"^--commits ef01: not a commit"):
        bench_commits.resolve(["ef01"], root=nowhere, trees=trees)


def test_prepare_writes_each_tree_with_its_commit_and_runs_nothing(capsys, tmp_path):
    head = _head()
    assert bench_commits.main(["--commits", "HEAD", ".", "--prepare", "--out", str(tmp_path)]) == 0
    tree = tmp_path / "trees" / head[:12]
    assert (tree / "COMMIT").read_text().strip() == head and (tree / "src" / "drvqwen" / "bench.py").is_file()
    assert capsys.readouterr().out.strip() == str(tree)
    assert not list(tmp_path.glob("*.json"))
    # There, without git: the prepared tree answers for the commit.
    assert bench_commits.resolve([head[:8]], root=tmp_path, trees=tmp_path / "trees") == [head]


def test_the_synthetic_key_follows_the_files_that_write_the_model(tmp_path):
    head = _head()
    a = bench_commits.write_tree(head, tmp_path / "a")
    b = bench_commits.write_tree(head, tmp_path / "b")
    assert bench_commits.synthetic_key(a) == bench_commits.synthetic_key(b)
    (b / "kernels" / "gemv_int4.cu").write_text("// a kernel edit: the model file is the same\n")
    assert bench_commits.synthetic_key(a) == bench_commits.synthetic_key(b)
    synthetic_py = b / "src" / "drvqwen" / "format" / "synthetic.py"
    synthetic_py.write_text(synthetic_py.read_text() + "\n# another weight generator\n")
    assert bench_commits.synthetic_key(a) != bench_commits.synthetic_key(b)


@pytest.mark.parametrize("same", [True, False])
def test_the_synthetic_file_is_written_once_only_when_every_tree_writes_the_same(monkeypatch, tmp_path, same):
    """Each run finds the synthetic file deleted when the trees' keys differ; with one key only the
    first run does (a stale file of another version is never used), the rest reuse its file."""
    real_run = subprocess.run
    synthetic = tmp_path / "syn_0.5b.nanoqwen"
    found = []

    def run(cmd, **kw):
        if cmd[:3] == [bench_commits.sys.executable, "-m", "drvqwen.bench"]:
            found.append(synthetic.exists())
            synthetic.write_bytes(b"model")
            out = Path(cmd[cmd.index("--json") + 1])
            out.write_text('{"modes": {"graph": {"itl_median_ms": 1.0}}}')
            return subprocess.CompletedProcess(cmd, 0, "", "")
        return real_run(cmd, **kw)

    monkeypatch.setattr(bench_commits.subprocess, "run", run)
    import drvqwen.bench

    monkeypatch.setattr(drvqwen.bench, "default_synthetic_path", lambda preset: synthetic)
    keys = iter(range(100))  # the keys themselves: test_the_synthetic_key_follows_…
    monkeypatch.setattr(bench_commits, "synthetic_key", lambda tree: "k" if same else str(next(keys)))
    synthetic.write_bytes(b"stale")
    assert bench_commits.main(["--commits", "HEAD", ".", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert found == ([False, True, True, True] if same else [False] * 4)
