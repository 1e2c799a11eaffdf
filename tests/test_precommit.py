"""The kvpatch-audit hook of .pre-commit-hooks.yaml, run as a pre-commit user
tries it: `pre-commit try-repo <this repository> kvpatch-audit --all-files`
in a git checkout. pre-commit installs kvpatch from this repository into its
own environment (pip, from the configured index)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, git

HOOK = "kvpatch-audit"
PRE_COMMIT = shutil.which("pre-commit")
pytestmark = pytest.mark.skipif(PRE_COMMIT is None, reason="pre-commit is not installed (pip install pre-commit)")


def _try_repo(checkout, tmp_path):
    env = {**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home"), "NO_COLOR": "1"}
    return subprocess.run([PRE_COMMIT, "try-repo", str(REPO), HOOK, "--all-files", "--color", "never"],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=600)


def test_hook_fails_on_hot_sites_then_passes_once_applied(example_git, tmp_path):
    r = _try_repo(example_git, tmp_path)
    assert r.returncode == 1 and "Failed" in r.stdout, r.stdout + r.stderr
    assert "hot" in r.stdout and "files scanned" not in r.stdout  # -q: the sites, no summary line
    subprocess.run([sys.executable, "-m", "kvpatch", "apply", str(example_git)], check=True, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    # Only KVP201's sites are left: suppress the one apply cannot rewrite, as a user would.
    npu = example_git / "python/sglang/srt/hardware_backend/npu/attention/mla_npu_backend.py"
    lines = npu.read_text().splitlines(True)
    lines[14] = lines[14].rstrip("\n") + "  # kvpatch: ignore\n"
    npu.write_text("".join(lines))
    git(example_git, "commit", "-qam", "suppress the npu site")
    r = _try_repo(example_git, tmp_path)
    assert r.returncode == 0 and "Passed" in r.stdout, r.stdout + r.stderr
