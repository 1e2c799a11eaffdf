"""audit's prefetch helper (kvpatch/analysis/prefetch.py) and the two-step tree scan.

The helper lists and byte-filters the tree in a forked process while the rules
load; whatever it hands back, or fails to, the scan's result must be the one a
single process computes: the same files, records, read errors (in path order)
and counts.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE
from kvpatch.analysis import discover, prefetch
from kvpatch.cli.commands import main
from kvpatch.engine import scan_tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the helper is Linux-only")

FILLER = 240  # over scan_tree's 200 files, so the worker pool runs


@pytest.fixture
def big(tmp_path) -> Path:
    """The example tree, padded with files that cannot hold a site, and two *.py links
    (read errors) far apart in path order."""
    root = tmp_path / "sglang"
    shutil.copytree(EXAMPLE, root)
    pad = root / "python" / "sglang" / "pad"
    pad.mkdir(parents=True)
    for i in range(FILLER):
        (pad / f"m{i:03d}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (root / "a_link.py").symlink_to(pad / "m000.py")
    (pad / "z_link.py").symlink_to(pad / "m001.py")
    return root


def _same(a, b) -> None:
    assert (a.files_scanned, a.candidates) == (b.files_scanned, b.candidates)
    assert a.files == b.files
    assert a.errors == b.errors


def test_the_helper_answers_what_this_process_would_read(big):
    pre = prefetch.start(big, None)
    assert pre is not None
    got = pre.take(big.resolve(), None)
    paths = list(discover.iter_python_paths(big.resolve()))
    assert got == (len(paths), discover.read_candidates(big.resolve(), enumerate(paths)))


def test_a_prefetched_scan_equals_a_one_process_scan(big):
    alone = scan_tree(big, jobs=1)
    assert [e.file for e in alone.errors] == ["a_link.py", "python/sglang/pad/z_link.py"]
    assert alone.candidates >= 1 and any(f.sites for f in alone.files)
    _same(scan_tree(big, jobs=2, prefetched=prefetch.start(big, None)), alone)
    _same(scan_tree(big, jobs=2), alone)  # the pool reads the tree itself: errors still in path order


def test_an_answer_for_another_root_or_exclude_test_is_not_used(big, tmp_path):
    alone = scan_tree(big, jobs=1)
    other = tmp_path / "other"
    shutil.copytree(big, other, symlinks=True)
    (other / "python" / "sglang" / "pad" / "m005.py").unlink()
    _same(scan_tree(big, jobs=2, prefetched=prefetch.start(other, None)), alone)

    def excluded(rel: str) -> bool:
        return rel.startswith("python/sglang/pad/")

    fewer = scan_tree(big, jobs=1, excluded=excluded)
    assert fewer.files_scanned == alone.files_scanned - FILLER - 1
    _same(scan_tree(big, jobs=2, excluded=excluded, prefetched=prefetch.start(big, None)), fewer)
    _same(scan_tree(big, jobs=2, excluded=excluded, prefetched=prefetch.start(big, excluded)), fewer)


def test_a_killed_helper_leaves_the_scan_to_this_process(big):
    alone = scan_tree(big, jobs=1)
    pre = prefetch.start(big, None)
    os.kill(pre.pid, signal.SIGKILL)
    assert pre.take(big.resolve(), None) is None
    pre = prefetch.start(big, None)
    os.kill(pre.pid, signal.SIGKILL)
    _same(scan_tree(big, jobs=2, prefetched=pre), alone)


def test_an_unread_helper_is_ended_and_reaped(big):
    pre = prefetch.start(big, None)
    pid = pre.pid
    pre.close()
    with pytest.raises(ChildProcessError):  # reaped: no zombie left behind
        os.waitpid(pid, os.WNOHANG)


def test_audit_output_does_not_depend_on_the_helper_or_the_jobs(big, monkeypatch):
    started = []
    real = prefetch.start
    monkeypatch.setattr(prefetch, "start", lambda *a: started.append(real(*a)) or started[-1])
    runs = [CliRunner().invoke(main, ["audit", "--json", *extra, str(big)]) for extra in ([], ["-j", "1"])]
    assert len(started) == 1 and started[0] is not None  # the helper ran for the first only
    assert [r.exit_code for r in runs] == [2, 2]  # the two links: read errors
    docs = [json.loads(r.stdout) for r in runs]
    for d in docs:
        d.pop("seconds")
    assert docs[0] == docs[1]
    assert docs[0]["files_scanned"] == FILLER + 2 + len(list(EXAMPLE.rglob("*.py")))
