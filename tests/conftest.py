"""Shared fixtures: copies of the bundled example tree, plain or as a git repo."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from kvpatch.rule import _builtin_package

# Tests import the rules' example modules as kvpatch.rules.*. Register this tree's rules/
# under that name first, as the engine does, so they import without an install too (the
# GPU machine runs the suite from a bare copy of the tree, PYTHONPATH only).
_builtin_package()

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "sglang"
FI_MLA = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"


def tree_hashes(root: Path) -> dict:
    """sha256 of every file under root, .git excluded."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and ".git" not in p.relative_to(root).parts:
            out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def one_torch_thread():
    """One torch thread for the tiny CPU verify cases: the pool only adds overhead (and noise on busy CI).
    The verify test modules take it with pytestmark = pytest.mark.usefixtures("one_torch_thread")."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def example(tmp_path) -> Path:
    dst = tmp_path / "sglang"
    shutil.copytree(EXAMPLE, dst)
    return dst


def git_init(root: Path) -> Path:
    """Make ROOT a git repository on branch main with one commit ("upstream") of everything in it,
    and user tester <tester@example.com> for the commits kvpatch makes later."""
    git(root, "init", "-q", "-b", "main")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "upstream")
    git(root, "config", "user.name", "tester")
    git(root, "config", "user.email", "tester@example.com")
    return root


@pytest.fixture
def example_git(example) -> Path:
    return git_init(example)
