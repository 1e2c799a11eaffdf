"""Originals live in git where there is git, as copies only where there is none (issue 10 item 3)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from click.testing import CliRunner

from conftest import FI_MLA, git, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.output.exitcodes import EXIT_ERROR
from kvpatch.checkout.originals import copy_path
from kvpatch.checkout.state import ORIGINALS, STATE_DIR, STATE_FILE, sha256

COPIES = f"{STATE_DIR}/{ORIGINALS}"
STATE = f"{STATE_DIR}/{STATE_FILE}"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def state(root: Path) -> dict:
    return json.loads((root / STATE).read_text())


def apply_ok(root: Path, *opts: str) -> dict:
    r = run("apply", *opts, root)
    assert r.exit_code == 0, r.output
    return state(root)


def assert_no_copies_and_git_recorded(root: Path, doc: dict, base: str) -> None:
    assert not (root / COPIES).exists()
    assert doc["files"] and all(f["original_copy"] is None and f["original_commit"] == base for f in doc["files"])
    for f in doc["files"]:
        assert sha256(git_bytes(root, base, f["path"])) == f["original_sha256"]


def git_bytes(root: Path, commit: str, path: str) -> bytes:
    return subprocess.run(["git", "-C", str(root), "cat-file", "--filters", f"{commit}:{path}"], check=True,
                          capture_output=True).stdout


def test_a_git_checkout_keeps_no_copies_and_reverts_byte_for_byte(example_git):
    base, before = git(example_git, "rev-parse", "HEAD"), tree_hashes(example_git)
    doc = apply_ok(example_git)
    assert_no_copies_and_git_recorded(example_git, doc, base)
    assert git(example_git, "rev-parse", "HEAD~1") == base  # the kvpatch commit's parent
    r = run("revert", example_git)
    assert r.exit_code == 0, r.output
    assert tree_hashes(example_git) == before


def test_autocrlf_originals_come_back_with_the_working_tree_line_endings(example_git):
    git(example_git, "config", "core.autocrlf", "true")
    for p in git(example_git, "ls-files").splitlines():
        (example_git / p).unlink()
    git(example_git, "checkout", "--", ".")
    assert b"\r\n" in (example_git / FI_MLA).read_bytes()
    base, before = git(example_git, "rev-parse", "HEAD"), tree_hashes(example_git)
    assert_no_copies_and_git_recorded(example_git, apply_ok(example_git), base)
    assert run("revert", example_git).exit_code == 0
    assert tree_hashes(example_git) == before


def test_revert_after_further_user_commits_reads_the_recorded_base(example_git):
    base = git(example_git, "rev-parse", "HEAD")
    original = (example_git / FI_MLA).read_bytes()
    apply_ok(example_git)
    for n in range(2):  # the user goes on working on the branch
        (example_git / "NOTES.md").write_text(f"note {n}\n")
        git(example_git, "add", "NOTES.md")
        git(example_git, "commit", "-qm", f"mine {n}")
    r = run("revert", example_git)
    assert r.exit_code == 0, r.output
    assert (example_git / FI_MLA).read_bytes() == original
    assert (example_git / "NOTES.md").read_text() == "note 1\n"
    assert git(example_git, "diff", base, "HEAD", "--name-only") == "NOTES.md"


def test_a_tampered_base_blob_is_refused_and_nothing_is_touched(example_git):
    base = git(example_git, "rev-parse", "HEAD")
    apply_ok(example_git)
    blob = git(example_git, "rev-parse", f"{base}:{FI_MLA}")
    (example_git / "evil.txt").write_text("import os; os.system('x')\n")
    evil = git(example_git, "hash-object", "-w", "evil.txt")
    (example_git / "evil.txt").unlink()
    git(example_git, "replace", blob, evil)  # git now answers the evil bytes for the base blob
    files, head = tree_hashes(example_git), git(example_git, "rev-parse", "HEAD")
    for force in ([], ["--force"]):
        r = run("revert", *force, example_git)
        assert r.exit_code == EXIT_ERROR, r.output
        assert "not the recorded original" in r.output and FI_MLA in r.output
        assert tree_hashes(example_git) == files and git(example_git, "rev-parse", "HEAD") == head


def test_a_dirty_original_is_still_copied(example_git):
    (example_git / FI_MLA).write_bytes((example_git / FI_MLA).read_bytes() + b"# mine, uncommitted\n")
    dirty = (example_git / FI_MLA).read_bytes()
    doc = apply_ok(example_git, "--allow-dirty", "--no-commit")
    f = next(f for f in doc["files"] if f["path"] == FI_MLA)
    assert f["original_copy"] == copy_path(FI_MLA) and f["original_commit"] is None  # git has other bytes
    assert (example_git / copy_path(FI_MLA)).read_bytes() == dirty
    assert run("revert", "--no-commit", example_git).exit_code == 0
    assert (example_git / FI_MLA).read_bytes() == dirty
