"""A patched branch describes itself (issue 18, items 1 and 4), on real git repositories.

The kvpatch commit carries its record (.kvpatch/state.json), so the checkout is
recognised as patched, and is revertible, from what git holds: after
`git clean -fdx`, `git stash -u`, in a fresh clone and in a CI-style shallow,
detached checkout. A tree whose files carry kvpatch's rewrites is never "not
patched". Revert after the user moved on restores exactly or refuses first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, FI_MLA, git, git_init, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.runtime import RUNTIME_FILENAME
from kvpatch.checkout.state import STATE_DIR, STATE_FILE

RUNTIME = FI_MLA.rsplit("/", 1)[0] + "/" + RUNTIME_FILENAME
STATE_REL = f"{STATE_DIR}/{STATE_FILE}"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def status_of(root: Path) -> dict:
    r = run("status", "--json", root)
    return json.loads(r.stdout[:r.stdout.rindex("}") + 1])


def audit_of(root: Path) -> dict:
    r = run("audit", "--json", root)
    assert r.exit_code in (0, 1), r.output
    return json.loads(r.stdout[:r.stdout.rindex("}") + 1])


def refs(repo: Path) -> str:
    return git(repo, "for-each-ref", "--format=%(refname) %(objectname)") + "\n" + git(repo, "rev-parse", "HEAD")


@pytest.fixture
def patched(tmp_path) -> tuple:
    """(a git checkout patched by `kvpatch apply`, the original files' hashes, the kvpatch branch)."""
    repo = tmp_path / "sglang"
    shutil.copytree(EXAMPLE, repo)
    git_init(repo)
    original = tree_hashes(repo)
    r = run("apply", repo)
    assert r.exit_code == 0, r.output
    return repo, original, git(repo, "symbolic-ref", "--short", "HEAD")


def _clean(repo: Path, tmp_path: Path) -> Path:
    git(repo, "clean", "-fdx")
    return repo


def _stash(repo: Path, tmp_path: Path) -> Path:
    (repo / "scratch.txt").write_text("an untracked file of the user's\n")
    git(repo, "stash", "-u")
    return repo


def _clone(repo: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(repo), str(dst))
    git(dst, "config", "user.name", "tester")
    git(dst, "config", "user.email", "tester@example.com")
    return dst


def _ci(repo: Path, tmp_path: Path) -> Path:
    """As actions/checkout does it: an empty repository, a depth-1 fetch, a detached checkout."""
    dst = tmp_path / "ci"
    dst.mkdir()
    git(dst, "init", "-q")
    branch = git(repo, "symbolic-ref", "--short", "HEAD")
    git(dst, "fetch", "-q", "--depth=1", f"file://{repo}", f"+refs/heads/{branch}:refs/remotes/origin/{branch}")
    git(dst, "checkout", "-q", "--detach", f"refs/remotes/origin/{branch}")
    git(dst, "config", "user.name", "ci")
    git(dst, "config", "user.email", "ci@example.com")
    return dst


WAYS = {"git clean -fdx": _clean, "git stash -u": _stash, "git clone": _clone, "CI checkout": _ci}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_patched_branch_is_recognised_from_what_git_holds(patched, tmp_path, way):
    repo, original, _ = patched
    tree = WAYS[way](repo, tmp_path)
    st = status_of(tree)
    assert st["state"] == "patched" and st["exit_code"] == 0, st
    # status never contradicts audit: audit lists the same rewrites as patched, nothing left to do.
    sites = audit_of(tree)["sites"]
    assert any(s["status"] == "patched" for s in sites)
    assert not [s for s in sites if s["status"] == "hot"]
    # The upgrade audit, against the commit apply started from, works too.
    r = run("audit", tree, "--against", "HEAD~1") if way != "CI checkout" else run("audit", tree, tree)
    assert r.exit_code in (0, 1) and "crashed" not in r.output, r.output
    # A second apply: nothing to do, no new commit.
    head = git(tree, "rev-parse", "HEAD")
    r = run("apply", tree)
    assert r.exit_code == 0 and "nothing to do" in r.output, r.output
    assert git(tree, "rev-parse", "HEAD") == head
    if way == "CI checkout":  # depth 1: the parent (the originals) is not there; revert says how to get it
        before = tree_hashes(tree)
        r = run("revert", tree)
        assert r.exit_code == 2 and "git fetch --deepen=1" in r.output, r.output
        assert tree_hashes(tree) == before
        git(tree, "fetch", "-q", "--deepen=1", f"file://{repo}", git(repo, "symbolic-ref", "HEAD"))
    r = run("revert", tree)
    assert r.exit_code == 0, r.output
    assert {k: v for k, v in tree_hashes(tree).items() if k != "scratch.txt"} == original
    assert git(tree, "diff", "HEAD~2", "HEAD", "--stat") == ""
    assert git(tree, "status", "--porcelain", "--ignored", "--", ".", ":!scratch.txt") == ""
    assert status_of(tree)["state"] == "not patched"


def test_a_fresh_clone_says_patched_reverts_to_the_original_bytes_and_audit_agrees(patched, tmp_path):
    repo, original, _ = patched
    clone = _clone(repo, tmp_path)
    r = run("status", clone)
    assert r.exit_code == 0 and r.stdout.startswith("patched:"), r.output
    audit = audit_of(clone)
    assert {s["file"] for s in audit["sites"] if s["status"] == "patched"} >= {FI_MLA}
    r = run("revert", clone)
    assert r.exit_code == 0, r.output
    assert tree_hashes(clone) == original


def test_files_that_carry_the_rewrite_are_never_not_patched_without_a_record(example):
    """Outside git (or with the record removed), the rewrites in the files speak for themselves."""
    assert run("apply", example).exit_code == 0
    shutil.rmtree(example / STATE_DIR)
    st = status_of(example)
    assert st["state"] == "patched" and st["exit_code"] == 0, st
    assert "no .kvpatch/state.json records them" in st["detail"]
    (example / RUNTIME).unlink()
    st = status_of(example)
    assert st["state"] == "partly patched" and {p["file"] for p in st["places"]} == {RUNTIME}, st


def test_a_crafted_committed_record_in_a_clone_touches_nothing_outside(patched, tmp_path):
    repo, _, _ = patched
    outside = tmp_path / "outside.py"
    outside.write_text("precious\n")
    state = json.loads((repo / STATE_REL).read_text())
    state["files"][0]["path"] = "../outside.py"
    (repo / STATE_REL).write_text(json.dumps(state))
    git(repo, "commit", "-qam", "a fork's record")
    clone = _clone(repo, tmp_path)
    before = tree_hashes(clone)
    for cmd in ("status", "revert", "apply"):
        r = run(cmd, clone)
        assert r.exit_code == 2 and "crashed" not in r.output, (cmd, r.output)
    assert outside.read_text() == "precious\n" and tree_hashes(clone) == before


# -- item 4: revert after the user moved on ----------------------------------------------------
def test_revert_on_a_branch_that_was_never_patched_refuses_and_says_which_branch(patched):
    repo, original, branch = patched
    git(repo, "checkout", "-q", "main")
    before, head = tree_hashes(repo), refs(repo)
    r = run("revert", repo)
    assert r.exit_code == 2, r.output
    err = r.output.strip().splitlines()
    assert len(err) == 1 and f"git checkout {branch}" in err[0], r.output
    assert "git commit failed" not in r.output and "rolled back" not in r.output
    assert tree_hashes(repo) == before and refs(repo) == head
    git(repo, "checkout", "-q", branch)  # where it says: revert works there
    assert run("revert", repo).exit_code == 0
    assert tree_hashes(repo) == original


def test_revert_of_an_uncommitted_apply_carried_to_another_branch_restores_without_a_commit(example_git):
    original = tree_hashes(example_git)
    assert run("apply", "--no-commit", example_git).exit_code == 0
    git(example_git, "checkout", "-q", "-b", "other")  # the modified files come along
    head = refs(example_git)
    r = run("revert", example_git)
    assert r.exit_code == 0, r.output
    assert "git commit failed" not in r.output and "no commit" in r.output
    assert tree_hashes(example_git) == original and refs(example_git) == head
    assert git(example_git, "status", "--porcelain", "--ignored") == ""


def test_revert_with_a_record_left_behind_on_a_branch_never_patched_refuses_first(patched):
    """An ignored record (an older kvpatch's, or one copied along) on a branch that never carried
    the patch: every file is already its original, and git would refuse an empty commit."""
    repo, original, branch = patched
    record = (repo / STATE_REL).read_bytes()
    git(repo, "checkout", "-q", "main")
    (repo / STATE_REL).write_bytes(record)  # untracked here, ignored by .kvpatch/.gitignore
    before, head = tree_hashes(repo), refs(repo)
    r = run("revert", repo)
    assert r.exit_code == 2, r.output
    err = r.output.strip().splitlines()
    assert len(err) == 1 and "nothing to revert" in err[0] and f"git checkout {branch}" in err[0], r.output
    assert "git commit failed" not in r.output
    assert tree_hashes(repo) == before and refs(repo) == head
