"""A checkout is untrusted input (issue 10, items 4, 13-15, 22c, 24).

Someone who clones a fork and runs kvpatch on it must never have a file outside
that checkout read, written or deleted. Each test plants what a fork could ship
(crafted state and journal paths, symbolic links at every place kvpatch writes,
FIFOs, crafted git trees) next to an outside canary, and checks the canary and
everything outside the tree are untouched, whatever the command.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, FI_MLA, git
from kvpatch.cli.commands import main
from kvpatch.runtime import RUNTIME_FILENAME
from kvpatch.checkout.safepath import GIT_DIR, UnsafePath, check_rel, tmp_path as scratch_of
from kvpatch.names import JOURNAL_FILE
from kvpatch.checkout.state import ORIGINALS, STATE_DIR, STATE_FILE
from kvpatch.checkout.write import TXN_DIR, stale_scratch

RUNTIME = FI_MLA.rsplit("/", 1)[0] + "/" + RUNTIME_FILENAME
CANARY = b"outside the checkout: must never change\n"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


@pytest.fixture
def world(tmp_path):
    """(checkout, outside dir with a canary file); the outside is snapshotted by tests."""
    tree = tmp_path / "sglang"
    shutil.copytree(EXAMPLE, tree)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary.py").write_bytes(CANARY)
    return tree, outside


def snap(d: Path) -> dict:
    """Every entry under d, links as their target, files by content."""
    out = {}
    for p in sorted(d.rglob("*")):
        rel = p.relative_to(d).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = p.read_bytes()
        else:
            out[rel] = "dir"
    return out


def one_line_error(r) -> None:
    assert "Traceback" not in r.output, r.output
    assert r.exit_code == 2, (r.exit_code, r.output)


# --- crafted .kvpatch/state.json ------------------------------------------------------

BAD_PATHS = {
    "absolute": lambda out: str(out / "canary.py"),
    "dotdot": lambda out: "../outside/canary.py",
    "inner-dotdot": lambda out: "python/../../outside/canary.py",
    "dot": lambda out: "./python/sglang/srt/layers/attention/flashinfer_mla_backend.py",
    "through-link": lambda out: "linkdir/canary.py",
    "dev-zero": lambda out: "/dev/zero",
    "git-config": lambda out: f"{GIT_DIR}/config",  # core.fsmonitor, core.hooksPath: code runs
    "nested-git-hook": lambda out: f"python/{GIT_DIR.upper()}/hooks/pre-commit",
}
STATE_FIELDS = [("files", "path"), ("files", "original_copy"), ("runtime_files", "path"),
                ("runtime_files", "original_copy")]


@pytest.mark.parametrize("field", STATE_FIELDS, ids=[f"{a}.{b}" for a, b in STATE_FIELDS])
@pytest.mark.parametrize("bad", sorted(BAD_PATHS))
def test_crafted_state_path_is_refused_by_every_command(world, field, bad):
    tree, outside = world
    assert run("apply", tree).exit_code == 0
    (tree / "linkdir").symlink_to(outside, target_is_directory=True)
    sp = tree / STATE_DIR / STATE_FILE
    doc = json.loads(sp.read_text())
    section, key = field
    rec = doc[section][0]
    rec[key] = BAD_PATHS[bad](outside)
    if section == "runtime_files" and key == "original_copy":
        rec["created"] = False
    sp.write_text(json.dumps(doc))
    (tree / GIT_DIR / "hooks").mkdir(parents=True)  # a checkout's own git folder is no target either
    (tree / GIT_DIR / "config").write_text("[core]\n")
    before_tree, before_out = snap(tree), snap(outside)
    for cmd in (["status"], ["revert"], ["revert", "--force"], ["apply"], ["status", "--json"]):
        r = run(*cmd, tree)
        one_line_error(r)
        assert "unsafe kvpatch state" in r.output, (cmd, r.output)
        assert snap(outside) == before_out, cmd
        assert snap(tree) == before_tree, cmd


def test_state_dir_as_a_link_is_refused(world):
    tree, outside = world
    assert run("apply", tree).exit_code == 0
    shutil.move(tree / STATE_DIR, outside / "moved")
    (tree / STATE_DIR).symlink_to(outside / "moved", target_is_directory=True)
    before = snap(outside)
    for cmd in (["status"], ["revert"], ["revert", "--force"]):
        r = run(*cmd, tree)
        one_line_error(r)
        assert snap(outside) == before


# --- crafted journal ------------------------------------------------------------------

def _journal(tree: Path, files, dirs=(), phase="replacing"):
    d = tree / STATE_DIR
    d.mkdir(exist_ok=True)
    (d / JOURNAL_FILE).write_text(json.dumps(
        {"op": "apply", "phase": phase, "files": files, "created_dirs": list(dirs)}))


JOURNAL_CASES = {
    "rel-absolute": lambda o: [{"rel": str(o / "canary.py"), "backup": None, "tmp": None, "created": True}],
    "rel-dotdot": lambda o: [{"rel": "../outside/canary.py", "backup": None, "tmp": None, "created": True}],
    "rel-through-link": lambda o: [{"rel": "linkdir/canary.py", "backup": None, "tmp": None, "created": True}],
    "backup-outside": lambda o: [{"rel": FI_MLA, "backup": "../outside/canary.py", "tmp": None,
                                  "created": False}],
    "backup-not-in-txn": lambda o: [{"rel": FI_MLA, "backup": "README.md", "tmp": None, "created": False}],
    "tmp-outside": lambda o: [{"rel": FI_MLA, "backup": None, "tmp": "../outside/canary.py", "created": False}],
    "tmp-not-sibling": lambda o: [{"rel": FI_MLA, "backup": None, "tmp": "README.md", "created": False}],
    "mode-setuid": lambda o: [{"rel": FI_MLA, "backup": f"{STATE_DIR}/{TXN_DIR}/0.orig", "tmp": None,
                               "created": False, "mode": 0o104777}],
    "created-dir-outside": lambda o: [],
    "rel-git-hook": lambda o: [{"rel": f"{GIT_DIR}/hooks/reference-transaction",
                                "backup": f"{STATE_DIR}/{TXN_DIR}/0.orig", "tmp": None, "created": False,
                                "mode": 0o755}],
}


@pytest.mark.parametrize("case", sorted(JOURNAL_CASES))
def test_crafted_journal_is_never_rolled_back(world, case):
    tree, outside = world
    (tree / "linkdir").symlink_to(outside, target_is_directory=True)
    (outside / "sub").mkdir()
    (tree / GIT_DIR / "hooks").mkdir(parents=True)  # where a planted hook would run
    dirs = ["../outside/sub"] if case == "created-dir-outside" else []
    _journal(tree, JOURNAL_CASES[case](outside), dirs)
    (tree / STATE_DIR / TXN_DIR).mkdir()
    (tree / STATE_DIR / TXN_DIR / "0.orig").write_bytes(b"evil = 1\n")
    before_tree, before_out = snap(tree), snap(outside)
    # apply and revert never roll a journal back on the side; recover refuses it.
    for cmd in (["apply"], ["revert"], ["revert", "--force"], ["recover"], ["recover", "--dry-run"]):
        r = run(*cmd, tree)
        one_line_error(r)
        assert snap(outside) == before_out, cmd
        assert snap(tree) == before_tree, cmd
    st = run("status", tree)
    assert st.exit_code == 4 and "Traceback" not in st.output  # interrupted: says so, touches nothing


def test_apply_names_recover_and_recover_shows_its_steps_first(world):
    tree, _ = world
    n = 4  # original copy, backend, runtime, state: crash after two replacements
    r = subprocess.run([sys.executable, "-m", "kvpatch", "apply", str(tree)], capture_output=True, text=True,
                       env={**os.environ, "KVPATCH_TEST_CRASH_AFTER": "2"})
    assert r.returncode == 137
    interrupted = snap(tree)
    a = run("apply", tree)
    one_line_error(a)
    assert "kvpatch recover" in a.output and snap(tree) == interrupted
    dry = run("recover", "--dry-run", tree)
    assert dry.exit_code == 0 and "would restore" in dry.output and snap(tree) == interrupted
    rec = run("recover", tree)
    assert rec.exit_code == 0 and "restore " in rec.output and "rolled back" in rec.output
    assert snap(tree) == snap(EXAMPLE)
    assert n == 4


# --- symbolic links at every place kvpatch writes -------------------------------------

WRITE_POINTS = [
    scratch_of(Path(FI_MLA)).as_posix(),  # the backend's temp file
    scratch_of(Path(RUNTIME)).as_posix(),  # the runtime's temp file
    f"{STATE_DIR}/{ORIGINALS}/{scratch_of(Path(FI_MLA)).as_posix()}",
    f"{STATE_DIR}/{scratch_of(Path(STATE_FILE)).as_posix()}",
    f"{STATE_DIR}/{scratch_of(Path(JOURNAL_FILE)).as_posix()}",
    f"{STATE_DIR}/{TXN_DIR}/0.orig",
    RUNTIME,
    f"{STATE_DIR}/{ORIGINALS}/{FI_MLA}",
]
DIR_POINTS = [STATE_DIR, f"{STATE_DIR}/{ORIGINALS}", f"{STATE_DIR}/{TXN_DIR}",
              f"{STATE_DIR}/{ORIGINALS}/python"]


@pytest.mark.parametrize("git_repo", [False, True], ids=["plain", "git"])
@pytest.mark.parametrize("point", WRITE_POINTS + DIR_POINTS)
def test_a_link_planted_at_a_write_point_is_never_written_through(world, point, git_repo):
    tree, outside = world
    if git_repo:
        git(tree, "init", "-q", "-b", "main")
        git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
        git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "upstream")
        git(tree, "config", "user.name", "t")
        git(tree, "config", "user.email", "t@t")
    link = tree / point
    link.parent.mkdir(parents=True, exist_ok=True)
    if point in DIR_POINTS:
        link.symlink_to(outside, target_is_directory=True)
    else:
        link.symlink_to(outside / "canary.py")
    before_out = snap(outside)
    r = run("apply", "--allow-dirty", tree)
    assert "Traceback" not in r.output, r.output
    assert snap(outside) == before_out, (point, r.output)
    assert not (tree / FI_MLA).is_symlink()
    if r.exit_code == 0:  # a link at a scratch name is removed (not followed) and the apply goes on
        assert "_kvpatch_rt.kv_for_mla_run(" in (tree / FI_MLA).read_text()
        rv = run("revert", "--force", tree)
        assert "Traceback" not in rv.output
        assert snap(outside) == before_out
    else:
        assert r.exit_code == 2 and (tree / FI_MLA).read_bytes() == (EXAMPLE / FI_MLA).read_bytes()


# --- reads -------------------------------------------------------------------------------

def test_fifo_and_device_links_named_py_are_skipped_not_read(world):
    tree, _ = world
    att = tree / "python/sglang/srt/layers/attention"
    os.mkfifo(att / "pipe_backend.py")
    (att / "zero_backend.py").symlink_to("/dev/zero")
    r = subprocess.run([sys.executable, "-m", "kvpatch", "audit", str(tree)], capture_output=True, text=True,
                       timeout=60)
    assert "Traceback" not in r.stderr
    assert "pipe_backend.py: not a regular file: skipped" in r.stderr
    assert "zero_backend.py: is a symbolic link: skipped" in r.stderr
    assert "flashinfer_mla_backend.py" in r.stdout  # the other files were audited


def test_audit_against_a_crafted_tree_writes_nothing_outside_its_temp_dir(world, tmp_path, monkeypatch):
    tree, _ = world
    git(tree, "init", "-q", "-b", "main")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "upstream")
    evil = b"x = pool.get_key_buffer(0).to(q.dtype)\n"
    blob = subprocess.run(["git", "-C", str(tree), "hash-object", "-w", "--stdin"], input=evil,
                          capture_output=True, check=True).stdout.decode().strip()
    inner = subprocess.run(["git", "-C", str(tree), "mktree"], input=f"100644 blob {blob}\tevil.py\n".encode(),
                           capture_output=True, check=True).stdout.decode().strip()
    head_tree = git(tree, "rev-parse", "HEAD^{tree}")
    listing = git(tree, "ls-tree", head_tree) + f"\n040000 tree {inner}\t..\n"
    crafted = subprocess.run(["git", "-C", str(tree), "mktree"], input=listing.encode(), capture_output=True,
                             check=True).stdout.decode().strip()
    commit = git(tree, "-c", "user.name=t", "-c", "user.email=t@t", "commit-tree", crafted, "-m", "evil")
    scratch = tmp_path / "scratch" / "tmp"
    scratch.mkdir(parents=True)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    r = run("audit", "--against", commit, tree)
    assert "Traceback" not in r.output
    assert not (scratch.parent / "evil.py").exists() and not (scratch / "evil.py").exists()
    assert not list(tmp_path.rglob("evil.py"))


@pytest.mark.parametrize("rel", ["/etc/passwd", "../x", "a/../b", "./a", "a//b", "", "a\\b", "a/\0",
                                 ".git/config", "sub/.git/hooks/x", ".Git/HEAD"])
def test_check_rel_refuses(rel):
    with pytest.raises(UnsafePath):
        check_rel(rel, "test")


# --- one writer at a time ----------------------------------------------------------------

HOLD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(30)
"""


def test_a_second_writer_is_refused_while_one_holds_the_checkout(world):
    tree, _ = world
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tree)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        before = snap(tree)
        for cmd in (["apply"], ["revert"], ["recover"]):
            r = run(*cmd, tree)
            one_line_error(r)
            assert "another kvpatch command is writing" in r.output
        assert snap(tree) == before
        _journal(tree, [])  # a journal, and its writer alive: in progress, not interrupted
        st = run("status", "--json", tree)
        assert json.loads(st.stdout)["state"] == "in progress"
    finally:
        holder.kill()
        holder.wait()
    st = run("status", "--json", tree)
    assert json.loads(st.stdout)["state"] == "interrupted"  # its writer is gone


def test_two_concurrent_applies_leave_one_consistent_patch(world):
    tree, _ = world
    procs = [subprocess.Popen([sys.executable, "-m", "kvpatch", "apply", str(tree)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    codes = sorted(p.wait(timeout=120) for p in procs)
    assert codes in ([0, 0], [0, 2]), codes  # the second waits its turn or is refused; never both half
    st = run("status", "--json", tree)
    assert json.loads(st.stdout)["state"] == "patched"
    assert run("revert", tree).exit_code == 0
    assert snap(tree) == snap(EXAMPLE)


# --- kill -9 at random instants -----------------------------------------------------------

@pytest.mark.parametrize("seed", range(12))
def test_kill_at_a_random_instant_leaves_original_patched_or_recoverable(world, seed):
    tree, _ = world
    original = snap(EXAMPLE)
    rng = random.Random(seed)
    p = subprocess.Popen([sys.executable, "-m", "kvpatch", "apply", str(tree)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(rng.uniform(0.2, 2.0))  # import, scan, build, write: the whole life of the command
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    st = json.loads(run("status", "--json", tree).stdout)
    if st["state"] == "interrupted":
        assert run("recover", tree).exit_code == 0
        assert snap(tree) == original
    elif st["state"] == "not patched":
        # Killed between making .kvpatch/ and its first journal: no target was touched,
        # and what is left is scratch that recover clears (tests/test_faults.py).
        if stale_scratch(tree):
            assert run("recover", tree).exit_code == 0
        assert snap(tree) == original
    else:
        assert st["state"] == "patched", st
        assert run("revert", tree).exit_code == 0
        assert snap(tree) == original


def _children(pid: int):
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc to find the workers")
def test_scan_workers_die_with_their_parent(tmp_path):
    tree = tmp_path / "many"
    shutil.copytree(EXAMPLE, tree)
    pkg = tree / "python/sglang/srt/filler"
    pkg.mkdir()
    for i in range(400):  # over the threshold where the scan starts worker processes
        (pkg / f"m{i}.py").write_text(f"def f{i}(pool, q):\n    return pool.get_key_buffer({i}).to(q.dtype)\n" * 40)
    p = subprocess.Popen([sys.executable, "-m", "kvpatch", "audit", "-j", "2", str(tree)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    end = time.monotonic() + 30
    while time.monotonic() < end and not workers:
        workers = _children(p.pid)
        time.sleep(0.05)
    if not workers:
        p.wait()
        pytest.skip("the scan finished before its workers could be seen")
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    time.sleep(1.0)
    alive = [w for w in workers if Path(f"/proc/{w}").exists()
             and "Z" not in (Path(f"/proc/{w}/stat").read_text().split()[2:3] or [""])[0]]
    assert not alive, f"workers {alive} outlived their parent"


# --- verify reads only what a validated state names ----------------------------------------

DAY = 86400


def _read_since(p: Path, stamp: float) -> bool:
    """Whether p was read since its atime was set to `stamp` (relatime updates an atime a day old)."""
    return os.stat(p).st_atime != stamp


@pytest.mark.parametrize("field", [("files", "path"), ("files", "original_copy")], ids=["path", "original_copy"])
@pytest.mark.parametrize("bad", ["absolute", "dotdot", "through-link", "git-config"])
def test_verify_never_reads_what_a_crafted_state_names(world, field, bad):
    tree, outside = world
    assert run("apply", tree).exit_code == 0
    (tree / "linkdir").symlink_to(outside, target_is_directory=True)
    canary = outside / "canary.py"
    stamp = time.time() - 2 * DAY
    os.utime(canary, (stamp, os.stat(canary).st_mtime))
    canary.read_bytes()
    if not _read_since(canary, stamp):
        pytest.skip("this file system does not record reads in atime (noatime)")
    os.utime(canary, (stamp, os.stat(canary).st_mtime))
    sp = tree / STATE_DIR / STATE_FILE
    doc = json.loads(sp.read_text())
    doc[field[0]][0][field[1]] = BAD_PATHS[bad](outside)
    sp.write_text(json.dumps(doc))
    r = run("verify", "--cpu", "--quick", tree)
    assert r.exit_code == 2 and "Traceback" not in r.output, r.output
    assert "unsafe kvpatch state" in r.output, r.output
    assert not _read_since(canary, stamp), "verify read a file outside the checkout"
