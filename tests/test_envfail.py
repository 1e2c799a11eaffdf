"""A failing environment is an error, not a crash; no silent partial apply (issue 18, items 2 and 3).

Each case runs the real command (`python -m kvpatch`, a subprocess) on a real
checkout and asks for: exit 2, one `error:` line naming the path and the cause
and saying what was left unchanged, and the tree (and git's refs) as before.
"Crashed" stays for kvpatch's own bugs: the last tests say which is which.

How each failure is made, and why a test may skip (the reason is printed):
- a read-only or immutable file: `chattr +i` (root, a filesystem that has it);
- a read-only filesystem or a full disk: a small tmpfs mounted for the test (root, `mount`);
- an unreadable file or .git: chmod 000; as root, where chmod does not stop reads, the
  command runs with CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH dropped (`setpriv`);
- git's "dubious ownership": the checkout chowned to another uid (root), in a HOME
  whose git config trusts nothing;
- an unwritable folder: chmod 555, which kvpatch honours for root too.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
from click.testing import CliRunner

import kvpatch as kvpatch_pkg
from conftest import EXAMPLE, FI_MLA, git, git_init, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.checkout.git import GitError
from kvpatch.checkout.state import STATE_DIR

FA3 = "python/sglang/srt/layers/attention/flashattention_backend.py"
ATTN = FI_MLA.rsplit("/", 1)[0]
ROOT = os.geteuid() == 0 if hasattr(os, "geteuid") else False
DROP_DAC = ["setpriv", "--bounding-set=-dac_override,-dac_read_search",
            "--inh-caps=-dac_override,-dac_read_search"]
REPO_SRC = Path(kvpatch_pkg.__file__).resolve().parents[1]  # the kvpatch under test, in the subprocess too


def kvpatch(*args, env=None, drop_dac=False) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvpatch", *map(str, args)]
    if drop_dac and ROOT:
        cmd = DROP_DAC + cmd
    full = {**os.environ, "PYTHONPATH": str(REPO_SRC), **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full, timeout=300)


def one_error(r: subprocess.CompletedProcess) -> str:
    """The command's one error line: exit 2, no crash, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "crashed" not in r.stderr and "Traceback" not in r.stderr, r.stderr
    errors = [ln for ln in r.stderr.splitlines() if ln.lower().startswith("error")]
    assert len(errors) == 1, r.stderr
    others = [ln for ln in r.stderr.splitlines() if ln.strip() and not ln.startswith(("error", "kvpatch "))]
    assert not others, r.stderr  # nothing else but the summary line
    return errors[0]


def refs(repo: Path) -> str:
    return git(repo, "for-each-ref", "--format=%(refname) %(objectname)") + git(repo, "symbolic-ref", "HEAD")


def repo_at(path: Path) -> Path:
    shutil.copytree(EXAMPLE, path)
    return git_init(path)


def patched_repo(path: Path) -> Path:
    repo = repo_at(path)
    r = kvpatch("apply", repo)
    assert r.returncode == 0, r.stderr
    return repo


# -- what the machine can do -----------------------------------------------------------------
@contextmanager
def immutable(path: Path):
    if not ROOT or shutil.which("chattr") is None:
        pytest.skip("chattr +i needs root and chattr")
    if subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode != 0:
        pytest.skip(f"chattr +i is not supported on the filesystem of {path}")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], capture_output=True)


@contextmanager
def tmpfs(where: Path, size: str):
    where.mkdir()
    if not ROOT or shutil.which("mount") is None:
        pytest.skip("a tmpfs mount needs root and mount")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def remount_ro(where: Path) -> None:
    r = subprocess.run(["mount", "-o", "remount,ro", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount {where} read-only: {r.stderr.strip()}")


def fill(where: Path) -> None:
    """Fill the filesystem of `where` up to the last byte."""
    with open(where / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC


def unreadable(path: Path) -> None:
    """chmod 000; as root the command then runs without the capabilities that bypass it."""
    if ROOT and (shutil.which("setpriv") is None
                 or subprocess.run(DROP_DAC + ["true"], capture_output=True).returncode != 0):
        pytest.skip("as root an unreadable file needs setpriv to drop CAP_DAC_OVERRIDE")
    path.chmod(0)


# -- item 2: the environment, command by command ---------------------------------------------------
def test_revert_of_an_immutable_file_is_one_error_line_and_changes_nothing(tmp_path):
    repo = patched_repo(tmp_path / "sglang")
    before, head = tree_hashes(repo), refs(repo)
    with immutable(repo / FI_MLA):
        line = one_error(kvpatch("revert", repo))
        assert FI_MLA in line and "immutable" in line and "nothing was changed" in line
        assert tree_hashes(repo) == before and refs(repo) == head
    assert kvpatch("revert", repo).returncode == 0  # nothing stuck


def test_apply_on_an_immutable_file_is_one_error_line(tmp_path):
    repo = repo_at(tmp_path / "sglang")
    before, head = tree_hashes(repo), refs(repo)
    with immutable(repo / FI_MLA):
        line = one_error(kvpatch("apply", repo))
        assert FI_MLA in line and "immutable" in line and "nothing was changed" in line
    assert tree_hashes(repo) == before and refs(repo) == head


def test_a_read_only_filesystem_is_one_error_line_for_apply_revert_and_audit_output(tmp_path):
    with tmpfs(tmp_path / "mnt", "8m") as mnt:
        fresh = repo_at(mnt / "fresh")
        done = patched_repo(mnt / "done")
        before = {"fresh": tree_hashes(fresh), "done": tree_hashes(done)}
        remount_ro(mnt)
        for cmd, tree, unchanged in (("apply", fresh, "nothing was changed"),
                                     ("revert", done, "nothing was changed")):
            line = one_error(kvpatch(cmd, tree))
            assert str(tree) in line and "read-only filesystem" in line and unchanged in line, (cmd, line)
        line = one_error(kvpatch("audit", fresh, "-o", fresh / "report.txt"))
        assert str(fresh / "report.txt") in line and "read-only" in line and "nothing was written" in line
        assert {"fresh": tree_hashes(fresh), "done": tree_hashes(done)} == before


def test_a_full_disk_is_one_error_line_naming_the_file_and_changes_nothing(tmp_path):
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        fresh = mnt / "fresh"
        shutil.copytree(EXAMPLE, fresh)  # outside git: git itself cannot run on a full disk
        done = mnt / "done"
        shutil.copytree(EXAMPLE, done)
        assert kvpatch("apply", done).returncode == 0
        before = {"fresh": tree_hashes(fresh), "done": tree_hashes(done)}
        fill(mnt)
        for cmd, tree in (("apply", fresh), ("revert", done)):
            line = one_error(kvpatch(cmd, tree))
            assert f"{tree}/" in line and "disk is full" in line and "nothing was changed" in line, (cmd, line)
        line = one_error(kvpatch("audit", fresh, "-o", mnt / "report.txt"))
        assert "report.txt" in line and "disk is full" in line and "nothing was written" in line
        assert {"fresh": tree_hashes(fresh), "done": tree_hashes(done)} == before
        (mnt / "filler").unlink()
        assert kvpatch("revert", done).returncode == 0  # nothing stuck


def test_an_audit_output_path_that_cannot_be_written_is_one_error_line(tmp_path, example):
    line = one_error(kvpatch("audit", example, "-o", tmp_path / "no" / "such" / "dir" / "report.sarif"))
    assert "report.sarif" in line and "No such file or directory" in line and "nothing was written" in line
    out = tmp_path / "report.txt"
    out.write_text("an older report\n")
    with immutable(out):
        line = one_error(kvpatch("audit", example, "-o", out))
        assert str(out) in line and "nothing was written" in line
    assert out.read_text() == "an older report\n"


def test_recover_refuses_an_immutable_target_before_touching_anything(tmp_path):
    repo = repo_at(tmp_path / "sglang")
    r = kvpatch("apply", repo, env={"KVPATCH_TEST_CRASH_AFTER": "3"})  # killed after 3 replacements
    assert r.returncode == 137, r.stderr
    journal = json.loads((repo / STATE_DIR / "journal.json").read_text())
    second = journal["files"][1]["rel"]  # the first would restore before the second fails
    before = tree_hashes(repo)
    with immutable(repo / second):
        line = one_error(kvpatch("recover", repo))
        assert second in line and "nothing was touched" in line and "journal" in line
        assert tree_hashes(repo) == before
    r = kvpatch("recover", repo)
    assert r.returncode == 0, r.stderr
    assert kvpatch("status", repo).stdout.startswith("not patched")


def test_config_with_a_rule_file_it_cannot_read_is_one_error_line(tmp_path):
    (tmp_path / "pyproject.toml").write_text('[tool.kvpatch]\nrules-path = ["rules"]\n')
    (tmp_path / "rules").mkdir()
    rule = tmp_path / "rules" / "my_rule.py"
    rule.write_text("X = 1\n")
    unreadable(rule)
    line = one_error(kvpatch("config", tmp_path, drop_dac=True))
    assert str(rule) in line and "permission denied" in line and "nothing was written" in line


@pytest.fixture
def distrustful_home(tmp_path) -> dict:
    """An environment whose git trusts no repository of another owner."""
    home = tmp_path / "home"
    home.mkdir()
    (home / ".gitconfig").write_text("")
    return {"HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": str(home / ".gitconfig"),
            "XDG_CONFIG_HOME": str(home)}


def test_git_refusing_the_repository_is_one_error_line_on_every_command(tmp_path, distrustful_home):
    if not ROOT:
        pytest.skip("dubious ownership is made by chowning the checkout to another uid: needs root")
    fresh = repo_at(tmp_path / "fresh")
    done = patched_repo(tmp_path / "done")
    before = {"fresh": tree_hashes(fresh), "done": tree_hashes(done)}
    heads = {"fresh": refs(fresh), "done": refs(done)}
    for tree in (fresh, done):
        subprocess.run(["chown", "-R", "54321:54321", str(tree)], check=True)
    try:
        for cmd, tree in (("status", done), ("audit", fresh), ("apply", fresh), ("revert", done)):
            line = one_error(kvpatch(cmd, tree, env=distrustful_home))
            assert "dubious ownership" in line and str(tree) in line and "safe.directory" in line, (cmd, line)
            assert ("nothing was changed" if cmd in ("apply", "revert") else "nothing was written") in line
    finally:
        for tree in (fresh, done):
            subprocess.run(["chown", "-R", "0:0", str(tree)], check=True)
    assert {"fresh": tree_hashes(fresh), "done": tree_hashes(done)} == before
    assert {"fresh": refs(fresh), "done": refs(done)} == heads


# -- item 3: no silent partial apply ---------------------------------------------------------------
def test_apply_refuses_the_whole_apply_when_a_file_cannot_be_read(tmp_path):
    repo = repo_at(tmp_path / "sglang")
    before, head = tree_hashes(repo), refs(repo)
    unreadable(repo / FA3)
    try:
        line = one_error(kvpatch("apply", repo, drop_dac=True))
    finally:
        (repo / FA3).chmod(0o644)
    assert FA3 in line and "cannot read" in line and "nothing was written" in line
    assert tree_hashes(repo) == before and refs(repo) == head  # FI_MLA not rewritten either


def test_a_file_git_lists_as_changed_but_cannot_be_read_is_named_as_unreadable(tmp_path):
    """git lists a file it cannot read as changed (edited, or only its index entry to be
    re-hashed, which load makes more likely): the refusal names what is wrong with it."""
    repo = repo_at(tmp_path / "sglang")
    p = repo / FA3
    p.write_text(p.read_text() + "# edited\n")
    unreadable(p)
    try:
        line = one_error(kvpatch("apply", repo, drop_dac=True))
    finally:
        p.chmod(0o644)
    assert FA3 in line and "cannot read" in line and "nothing was written" in line, line
    assert "uncommitted changes" not in line


def test_a_changed_file_made_a_link_to_a_fifo_outside_is_never_opened(tmp_path):
    """The unreadable-file check opens nothing through a link and never blocks: a tracked
    file replaced by a link to a FIFO outside the checkout is an uncommitted change."""
    repo = repo_at(tmp_path / "sglang")
    fifo = tmp_path / "outside.fifo"
    os.mkfifo(fifo)
    (repo / FA3).unlink()
    (repo / FA3).symlink_to(fifo)
    line = one_error(kvpatch("apply", repo))
    assert "uncommitted changes" in line and FA3 in line, line


def test_a_checkout_whose_dot_git_cannot_be_read_is_refused(tmp_path):
    repo = repo_at(tmp_path / "sglang")
    before = tree_hashes(repo)
    unreadable(repo / ".git")
    try:
        r = kvpatch("apply", repo, drop_dac=True)
    finally:
        (repo / ".git").chmod(0o755)
    line = one_error(r)
    assert f"{repo}/.git" in line and "cannot be read" in line and "nothing was changed" in line
    assert tree_hashes(repo) == before and not (repo / STATE_DIR).exists()


@pytest.mark.parametrize("git_repo", [True, False], ids=["git", "plain"])
def test_an_unwritable_directory_is_refused_like_an_unwritable_file_also_for_root(tmp_path, git_repo):
    tree = tmp_path / "sglang"
    shutil.copytree(EXAMPLE, tree)
    if git_repo:
        git_init(tree)
    before = tree_hashes(tree)
    (tree / ATTN).chmod(0o555)
    try:
        line = one_error(kvpatch("apply", tree))
    finally:
        (tree / ATTN).chmod(0o755)
    assert f"{tree / ATTN}" in line and "not writable" in line and "nothing was changed" in line
    assert tree_hashes(tree) == before


# -- which is which: the environment against kvpatch's own bugs ------------------------------------
@pytest.mark.parametrize("exc, env", [
    (OSError(errno.ENOSPC, "No space left on device", "/x/f.py"), True),
    (OSError(errno.EROFS, "Read-only file system", "/x/f.py"), True),
    (PermissionError(errno.EACCES, "Permission denied", "/x/f.py"), True),
    (PermissionError(errno.EPERM, "Operation not permitted", "/x/f.py"), True),
    (GitError("fatal: detected dubious ownership in repository at '/x'\nTo add an exception ..."), True),
    ("EnvFailure", True),
    (KeyError("files"), False),
    (TypeError("unsupported operand"), False),
    (AttributeError("'NoneType' object has no attribute 'rel'"), False),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/x/f.py"), False),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else str(v))
def test_the_environment_is_told_from_kvpatchs_own_bugs(exc, env, example, monkeypatch):
    def boom(*a, **k):
        if exc == "EnvFailure":
            from kvpatch.checkout.envfail import EnvFailure

            raise EnvFailure("/x/out: cannot write the output; nothing was written")
        raise exc

    monkeypatch.setattr("kvpatch.status.status", boom)
    r = CliRunner().invoke(main, ["status", str(example)])
    assert r.exit_code == 2
    if env:
        assert "crashed" not in r.output and r.output.startswith("error: "), r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    else:
        assert "kvpatch crashed in `kvpatch status`" in r.output, r.output
