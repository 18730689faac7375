"""tools/rebuild_cubins.py on a throw-away kernels/ + ptx/ tree (test_compile's) and temporary
caches: rebuild compiles an old cache's recorded builds from the changed sources, so that the
tree's own compiles then hit; keep copies exactly the entries a tree hits. Needs NVRTC (no GPU)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from drvqwen.cuda.nvrtc import compile_kernel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import rebuild_cubins  # noqa: E402
from test_compile import _tree  # noqa: E402  # k.cu including a.cuh (and c.cuh) and ../ptx/b.cuh

SCALES = ({"SCALE": "1.0f"}, {"SCALE": "2.0f"})


def _compile_all(tree: Path, cache: Path):
    return [compile_kernel("k", defines=d, kernels_dir=tree / "kernels", include_dir=tree / "ptx", cache_dir=cache)
            for d in SCALES]


def test_rebuild_then_the_changed_tree_hits_and_keep_takes_what_a_tree_hits(tmp_path):
    tree, old_tree = tmp_path / "tree", tmp_path / "old_tree"
    _tree(tree)
    old = _compile_all(tree, tmp_path / "old")
    shutil.copytree(tree, old_tree)
    c = tree / "ptx" / "c.cuh"
    c.write_text(c.read_text().replace("x + 1.0f", "x + 3.0f"))     # a header change: every build misses
    assert not any(k.cache_hit for k in _compile_all(tree, tmp_path / "scratch"))

    requests, missing = rebuild_cubins.rebuild_requests(tmp_path / "old", tree=tree)
    assert sorted(r[1]["SCALE"] for r in requests) == ["1.0f", "2.0f"] and missing == []
    built = rebuild_cubins.rebuild(requests, tmp_path / "new", tree=tree)
    assert not any(k.cache_hit for k in built)
    again = _compile_all(tree, tmp_path / "new")
    assert all(k.cache_hit for k in again)
    assert {k.cache_key for k in again}.isdisjoint(k.cache_key for k in old)

    both = tmp_path / "both"
    shutil.copytree(tmp_path / "old", both)
    shutil.copytree(tmp_path / "new", both, dirs_exist_ok=True)
    assert rebuild_cubins.keep(both, tmp_path / "kept_new", [tree]) == 2
    assert all(k.cache_hit for k in _compile_all(tree, tmp_path / "kept_new"))
    assert rebuild_cubins.keep(both, tmp_path / "kept_old", [old_tree]) == 2
    kept_old = {p.name for p in (tmp_path / "kept_old").glob("*.cubin")}
    assert kept_old == {p.name for p in (tmp_path / "old").glob("*.cubin")}
    assert rebuild_cubins.keep(both, tmp_path / "kept_all", [tree, old_tree]) == 4
    # from the command line, the flag repeated or given both trees at once: all four either way
    for i, flags in enumerate((["--tree", str(tree), "--tree", str(old_tree)], ["--tree", str(tree), str(old_tree)])):
        out = tmp_path / f"kept_cli_{i}"
        assert rebuild_cubins.main(["keep", str(both), str(out), *flags]) == 0
        assert len(list(out.glob("*.cubin"))) == 4


def test_keep_as_a_seed_writes_the_parts_gpu_check_unpacks(tmp_path):
    """keep --seed: the kept entries as one tar.xz in numbered parts; concatenated and unpacked
    (as gpu_check.sh's CUBIN_SEED does) they are a cache the tree hits, each file byte for byte;
    a small part size splits it, and earlier parts are replaced."""
    import tarfile

    tree = tmp_path / "tree"
    _tree(tree)
    _compile_all(tree, tmp_path / "cache")
    seed = tmp_path / "seed"
    (seed).mkdir()
    (seed / "cubins.tar.xz.07").write_bytes(b"stale")
    assert rebuild_cubins.main(["keep", str(tmp_path / "cache"), str(seed), "--tree", str(tree), "--seed"]) == 0
    parts = sorted(seed.glob("cubins.tar.xz.*"))
    assert [p.name for p in parts] == ["cubins.tar.xz.00"]
    small = rebuild_cubins.write_seed(tmp_path / "cache", tmp_path / "small", part_bytes=1000)
    assert len(small) > 1 and all(p.stat().st_size == 1000 for p in small[:-1])
    for name, ps in (("one", parts), ("split", small)):
        joined = tmp_path / f"{name}.tar.xz"
        joined.write_bytes(b"".join(p.read_bytes() for p in ps))
        with tarfile.open(joined, "r:xz") as tar:
            tar.extractall(tmp_path / f"unpacked_{name}", filter="data")
        unpacked = tmp_path / f"unpacked_{name}"
        cached = sorted(p.relative_to(tmp_path / "cache") for p in (tmp_path / "cache").rglob("*") if p.is_file())
        assert sorted(p.relative_to(unpacked) for p in unpacked.rglob("*") if p.is_file()) == cached
        assert all((unpacked / r).read_bytes() == (tmp_path / "cache" / r).read_bytes() for r in cached)
        assert all(k.cache_hit for k in _compile_all(tree, unpacked))


def test_touching_selects_by_file_name_and_missing_kernels_are_named(tmp_path):
    tree = tmp_path / "tree"
    _tree(tree)
    _compile_all(tree, tmp_path / "old")
    assert len(rebuild_cubins.rebuild_requests(tmp_path / "old", {"c.cuh"}, tree=tree)[0]) == 2
    assert len(rebuild_cubins.rebuild_requests(tmp_path / "old", {"k.cu"}, tree=tree)[0]) == 2
    assert rebuild_cubins.rebuild_requests(tmp_path / "old", {"other.cuh"}, tree=tree)[0] == []
    (tree / "kernels" / "k.cu").unlink()
    requests, missing = rebuild_cubins.rebuild_requests(tmp_path / "old", tree=tree)
    assert requests == [] and missing == ["k"]


def test_bad_folders_are_one_line_errors(tmp_path, capsys):
    assert rebuild_cubins.main(["rebuild", str(tmp_path / "nope")]) == 2
    assert rebuild_cubins.main(["keep", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert rebuild_cubins.main(["keep", str(tmp_path), str(tmp_path / "out"), "--tree", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("rebuild_cubins: ") for line in err)
