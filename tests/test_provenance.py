"""drvqwen.provenance: the digest says which code ran, and the commit claim is checked."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from drvqwen.errors import DrvqwenError
from drvqwen.provenance import SOURCE_COMMIT_ENV, digest_of, digest_of_commit, source_commit, source_digest

ROOT = Path(__file__).resolve().parents[1]


def test_digest_depends_on_every_byte_and_path_not_on_order():
    files = [("src/drvqwen/a.py", b"x = 1\n"), ("kernels/k.cu", b"// k\n")]
    assert digest_of(files) == digest_of(list(reversed(files)))
    assert digest_of(files) != digest_of([("src/drvqwen/a.py", b"x = 2\n"), files[1]])
    assert digest_of(files) != digest_of([("src/drvqwen/b.py", b"x = 1\n"), files[1]])
    # a byte moved across the path/content boundary changes the digest too
    assert digest_of([("a", b"bc")]) != digest_of([("ab", b"c")])


def test_commit_claim_must_be_a_full_hash(monkeypatch):
    monkeypatch.setenv(SOURCE_COMMIT_ENV, "d1f479d5")
    with pytest.raises(DrvqwenError, match="40-digit"):
        source_commit()
    full = "d1f479d34f68b9e1f720cc5eeb7650dfc0311446"
    monkeypatch.setenv(SOURCE_COMMIT_ENV, full)
    assert source_commit() == full


def test_checkout_commit_is_dirty_exactly_when_the_runtime_files_differ(monkeypatch):
    monkeypatch.delenv(SOURCE_COMMIT_ENV, raising=False)
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    same = digest_of_commit(head, ROOT) == source_digest()
    assert source_commit() == (head if same else head + "+dirty")
    changed = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "src/drvqwen", "kernels", "ptx"],
                             capture_output=True, text=True, check=True).stdout
    if not changed.strip():   # a clean tree (CI's clone): the digest is HEAD's
        assert same
