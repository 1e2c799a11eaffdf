"""Interrupted at any instant (issue 10, items 16-18).

apply and revert are one transaction, files and git alike: after a kill -9 at
any instant the checkout is as before, or as after, or `status` says
interrupted and `recover` brings back the state before the command byte for
byte (the working tree) and ref for ref (HEAD, every branch, the index).
The kill points are each file replacement (KVPATCH_TEST_CRASH_AFTER), each git
step (a commit hook that kills the whole command) and random instants.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, git, git_init
from kvpatch import revert
from kvpatch.checkout import gittxn
from kvpatch.checkout import write
from kvpatch import patch as P
from kvpatch.cli.commands import main
from kvpatch.checkout.gittxn import BRANCH_PREFIX, HEADS
from kvpatch.checkout.state import STATE_DIR, STATE_FILE
from kvpatch.names import JOURNAL_FILE
from kvpatch.checkout.safepath import tmp_path
from kvpatch.checkout.write import CRASH_ENV, GIT_KEY, TXN_DIR

INTERRUPTED = "interrupted"
# Git hooks run inside the commit step: one that kills the command's process
# group stops it just before (pre-commit) or just after (post-commit) the commit.
GIT_KILL_POINTS = ["pre-commit", "post-commit"]
KILL_HOOK = f"#!{sys.executable}\nimport os, signal\nos.killpg(os.getpgrp(), signal.SIGKILL)\n"
RANDOM_KILLS = 6
RANDOM_SIGNALS = 3
STATE_REL = f"{STATE_DIR}/{STATE_FILE}"
# A write killed after its journal went (done) can leave its backups here; one
# killed before its first journal was in place, the journal's temp file or an
# empty state folder.
SCRATCH = f"{STATE_DIR}/{TXN_DIR}"
JOURNAL_TMP = tmp_path(Path(STATE_DIR) / JOURNAL_FILE).as_posix()


def _scratch(fs: dict) -> bool:
    return any(k.startswith(SCRATCH) or k == JOURNAL_TMP for k in fs) or (
        fs.get(STATE_DIR) == "dir" and not any(k.startswith(STATE_DIR + "/") for k in fs))
STAMPED = "state.json (stamped with the time of the run)"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def start(cmd: str, root: Path, env=None) -> subprocess.Popen:
    """kvpatch CMD ROOT in its own process group (so a kill reaches its workers too)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVPATCH_TEST_")}
    full.update(env or {})
    return subprocess.Popen([sys.executable, "-m", "kvpatch", "--color", "never", cmd, str(root)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=full,
                            start_new_session=True)


def files(root: Path) -> dict:
    """Every entry under root but .git: links as their target, files by content."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if rel_dir.parts[:1] == (".git",):
            continue
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = (rel_dir / name).as_posix()
            if rel == ".git":
                continue
            out[rel] = ("link:" + os.readlink(p)) if p.is_symlink() else (p.read_bytes() if p.is_file() else "dir")
    return out


def git_state(root: Path) -> dict:
    """HEAD (symbolic or detached), every ref, every index entry."""
    if not (root / ".git").exists():
        return {}
    head = subprocess.run(["git", "-C", str(root), "symbolic-ref", "-q", "HEAD"], capture_output=True, text=True)
    return {"HEAD": head.stdout.strip() or git(root, "rev-parse", "HEAD"),
            "refs": git(root, "for-each-ref", "--format=%(refname) %(objectname)"),
            "index": git(root, "ls-files", "-s")}


def whole(root: Path) -> tuple:
    return files(root), git_state(root)


def make_tree(tmp_path: Path, name: str, with_git: bool) -> Path:
    root = tmp_path / name
    shutil.copytree(EXAMPLE, root)
    if with_git:
        git_init(root)
    return root


def prepare(tmp_path: Path, name: str, cmd: str, with_git: bool) -> Path:
    """A tree ready for `cmd`: the example for apply, the example patched (and committed) for revert."""
    root = make_tree(tmp_path, name, with_git)
    if cmd == "revert":
        r = run("apply", root)
        assert r.exit_code == 0, r.output
    return root


def after_kill(root: Path, before: tuple, after: tuple, where: str) -> str:
    """The checkout after a kill: before, after, or interrupted and recovered to before."""
    st = run("status", "--json", root)
    assert "Traceback" not in st.output, (where, st.output)
    state = json.loads(st.stdout)["state"]
    if state == INTERRUPTED:
        _clear_git_locks(root, where)
        rc = run("recover", root)
        assert rc.exit_code == 0 and "Traceback" not in rc.output, (where, rc.output)
        got = whole(root)
        assert got[0] == before[0], f"{where}: recover did not restore every byte"
        assert got[1] == before[1], f"{where}: recover did not restore HEAD, the refs and the index"
        assert run("status", "--json", root).exit_code != 4
        return state
    got = whole(root)
    assert got == before or _shape(got) in (_shape(before), _shape(after)), (where, state, _differ(got, after))
    if _scratch(got[0]):  # killed outside its journal's lifetime: recover clears the rest
        assert run("recover", root).exit_code == 0
        cleared = whole(root)
        assert _shape(cleared) == _shape(got) and not _scratch(cleared[0]), (where, sorted(cleared[0]))
        if _shape(got) == _shape(before):  # nothing was written: every byte is back
            assert cleared == before, where
    return state


@pytest.mark.parametrize("cmd", ["apply", "revert"])
@pytest.mark.parametrize("left", ["empty state folder", "journal cut short"])
def test_a_kill_before_the_first_journal_leaves_scratch_that_recover_clears(tmp_path, outcomes, cmd, left):
    """The instant between making .kvpatch/ and renaming the first journal into
    place (seen once in CI's random kills): no target is touched, so the
    checkout is what it was, and recover removes the leftover, byte for byte."""
    root = prepare(tmp_path, "t", cmd, True)
    before = whole(root)
    (root / STATE_DIR).mkdir(exist_ok=True)
    if left == "journal cut short":
        (root / JOURNAL_TMP).write_text('{"op": "' + cmd)
    elif cmd == "revert":
        pytest.skip("a patched checkout's state folder is never empty")
    got = whole(root)
    assert got != before and _scratch(got[0])
    assert after_kill(root, before, outcomes[cmd, True][1], f"{cmd} killed before its journal ({left})") != \
        INTERRUPTED
    assert whole(root) == before
    r = run("recover", root)
    assert r.exit_code == 0 and "nothing to recover" in r.output, r.output


def _clear_git_locks(root: Path, where: str) -> None:
    """A kill while git itself writes the index or a ref (git add, checkout -b, commit,
    update-ref: the commit is git's own, for the hooks) leaves git's lock file
    (index.lock, HEAD.lock, refs/heads/...lock). recover cannot tell it from a live
    git process's, so it names the lock and touches nothing; the user removes it, as
    git's own message says, and recovers."""
    git_dir = root / ".git"
    locks = sorted(p for p in git_dir.rglob("*.lock") if p.is_file())
    if not locks:
        return
    held = whole(root)
    r = run("recover", root)
    named = [p for p in locks if p.relative_to(git_dir).as_posix() in r.output]
    assert r.exit_code == 2 and named and whole(root) == held, (where, [str(p) for p in locks], r.output)
    for p in locks:
        p.unlink()


def _differ(got: tuple, ref: tuple) -> dict:
    """What a checkout holds that differs from a finished run's (the paths only): a failed
    kill test names the file, not a truncated dict of the whole tree."""
    (g, gg), (r, rg) = _shape(got), _shape(ref)
    return {"only here": sorted(set(g) - set(r)), "missing": sorted(set(r) - set(g)),
            "other bytes": sorted(k for k in set(g) & set(r) if g[k] != r[k]), "git": gg == rg}


def _shape(w: tuple) -> tuple:
    """A finished run, less what differs from run to run: the time in state.json, commit shas."""
    fs, g = w
    fs = {k: (STAMPED if k == STATE_REL else v) for k, v in fs.items()
          if not k.startswith(SCRATCH) and k != JOURNAL_TMP}
    if STATE_DIR in fs and not any(k.startswith(STATE_DIR + "/") for k in fs):
        del fs[STATE_DIR]  # it only held the scratch
    if not g:
        return fs, g
    return fs, (_branch(g["HEAD"]), [_branch(r.split()[0]) for r in g["refs"].splitlines()],
                [e.split("\t")[-1] for e in g["index"].splitlines()])


def _branch(ref: str) -> str:
    """kvpatch's branch names carry the upstream commit, which differs from tree to tree."""
    prefix = HEADS + BRANCH_PREFIX
    return prefix + "*" if ref.startswith(prefix) else ref


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    """For each (cmd, git): the whole checkout before and after one uninterrupted run, and its wall time."""
    base = tmp_path_factory.mktemp("outcomes")
    out = {}
    for cmd in ("apply", "revert"):
        for with_git in (False, True):
            root = prepare(base, f"{cmd}-{with_git}", cmd, with_git)
            before = whole(root)
            t0 = time.monotonic()
            p = start(cmd, root)
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            out[cmd, with_git] = (before, whole(root), time.monotonic() - t0)
    return out


def _n_writes(outcomes, cmd: str, with_git: bool) -> int:
    before, after, _ = outcomes[cmd, with_git]
    changed = {k for k in set(before[0]) | set(after[0]) if before[0].get(k) != after[0].get(k)}
    return len({k for k in changed if not isinstance(before[0].get(k, after[0].get(k)), str)})


# --- every file replacement ----------------------------------------------------------------

@pytest.mark.parametrize("with_git", [False, True], ids=["plain", "git"])
@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_kill_after_each_replacement_recovers_byte_for_byte_and_ref_for_ref(tmp_path, outcomes, cmd, with_git):
    before_ref, after_ref, _ = outcomes[cmd, with_git]
    for k in range(_n_writes(outcomes, cmd, with_git) + 1):
        root = prepare(tmp_path, f"k{k}", cmd, with_git)
        before = whole(root)
        p = start(cmd, root, {CRASH_ENV: str(k)})
        _, err = p.communicate(timeout=120)
        assert p.returncode == 137, (k, err)
        assert after_kill(root, before, after_ref, f"{cmd} killed after {k} replacement(s)") == INTERRUPTED


# --- every git step ----------------------------------------------------------------------

@pytest.mark.parametrize("hook", GIT_KILL_POINTS)
@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_kill_inside_the_git_commit_recovers_head_branches_and_index(tmp_path, outcomes, cmd, hook):
    root = prepare(tmp_path, "t", cmd, True)
    before = whole(root)
    hook_file = root / ".git" / "hooks" / hook
    hook_file.write_text(KILL_HOOK)
    hook_file.chmod(0o755)
    p = start(cmd, root)
    _, err = p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, err)
    hook_file.unlink()
    _clear_git_locks(root, f"{cmd} killed at {hook}")
    killed = whole(root)
    dry = run("recover", "--dry-run", root)
    assert dry.exit_code == 0 and whole(root) == killed, dry.output
    if cmd == "apply":  # the steps are shown before they are taken
        assert "would switch HEAD back to main" in dry.output and "would delete branch kvpatch/" in dry.output
    elif hook == "post-commit":
        assert "would move kvpatch/" in dry.output, dry.output
    state = after_kill(root, before, outcomes[cmd, True][1], f"{cmd} killed at {hook}")
    assert state == INTERRUPTED  # the journal outlives every git step


# --- random instants -----------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(RANDOM_KILLS))
@pytest.mark.parametrize("with_git", [False, True], ids=["plain", "git"])
@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_kill_at_a_random_instant(tmp_path, outcomes, cmd, with_git, seed):
    _, after_ref, wall = outcomes[cmd, with_git]
    root = prepare(tmp_path, "r", cmd, with_git)
    before = whole(root)
    p = start(cmd, root)
    # The writes come last: aim at the second half of the command's life, and a bit past it.
    time.sleep(random.Random(f"{cmd}{with_git}{seed}").uniform(0.4 * wall, 1.1 * wall))
    os.killpg(p.pid, signal.SIGKILL)
    p.communicate(timeout=60)
    after_kill(root, before, after_ref, f"{cmd} killed at random (seed {seed})")



@pytest.mark.parametrize("seed", range(RANDOM_SIGNALS))
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_ctrl_c_or_sigterm_at_a_random_instant_rolls_back_in_process(tmp_path, outcomes, cmd, sig, seed):
    """To the whole process group, as Ctrl-C sends it (git and its hooks included):
    the command undoes itself, files and git, and leaves no journal."""
    _, after_ref, wall = outcomes[cmd, True]
    root = prepare(tmp_path, "s", cmd, True)
    before = whole(root)
    p = start(cmd, root)
    time.sleep(random.Random(f"{cmd}{sig}{seed}").uniform(0.4 * wall, 1.1 * wall))
    os.killpg(p.pid, sig)
    _, err = p.communicate(timeout=60)
    assert "Traceback" not in err, err
    assert after_kill(root, before, after_ref, f"{cmd} sent {sig.name} (seed {seed})") != INTERRUPTED

# --- a journal's git record is untrusted too -------------------------------------------------

BAD_GIT_RECORDS = {
    "not-an-object": "refs/heads/main",
    "head-not-a-branch": {"head": "HEAD", "commit": None, "branches": []},
    "head-a-tag": {"head": "refs/tags/v1", "commit": None, "branches": []},
    "head-dotdot": {"head": "refs/heads/../../config", "commit": None, "branches": []},
    "commit-not-a-sha": {"head": "refs/heads/main", "commit": "main~1", "branches": []},
    "commit-an-option": {"head": "refs/heads/main", "commit": "--output=/tmp/x", "branches": []},
    "branches-not-a-list": {"head": "refs/heads/main", "commit": None, "branches": "refs/heads/kvpatch/x"},
    "branch-malformed": {"head": "refs/heads/main", "commit": None, "branches": ["refs/heads/a..b"]},
}


def _write_journal(root: Path, files, git_record) -> None:
    (root / STATE_DIR).mkdir(exist_ok=True)
    (root / STATE_DIR / JOURNAL_FILE).write_text(json.dumps(
        {"op": "apply", "phase": "replacing", "files": files, "created_dirs": [], GIT_KEY: git_record}))


@pytest.mark.parametrize("case", sorted(BAD_GIT_RECORDS))
def test_a_malformed_git_record_is_refused_and_nothing_touched(tmp_path, case):
    root = make_tree(tmp_path, "t", True)
    _write_journal(root, [], BAD_GIT_RECORDS[case])
    before = whole(root)
    for cmd in (["recover"], ["recover", "--dry-run"], ["apply"], ["revert"]):
        r = run(*cmd, root)
        assert r.exit_code == 2 and "Traceback" not in r.output, (cmd, r.output)
        assert whole(root) == before, cmd


def test_a_well_formed_git_record_moves_no_user_branch_or_head(tmp_path):
    """A fork's journal naming an older commit: recover never strips the user's
    commits, never switches them off their own branch, never resets the index
    to another commit, and deletes no branch but the one a write made."""
    root = make_tree(tmp_path, "t", True)
    base = git(root, "rev-parse", "HEAD")
    (root / "README.md").write_text("a user's own commit\n")
    git(root, "commit", "-qam", "kvpatch: a user's commit, named like kvpatch's")
    git(root, "branch", BRANCH_PREFIX + "mine")  # a user branch at the user's commit
    git(root, "switch", "-q", "-c", "feature")
    (root / "README.md").write_text("staged, not committed\n")
    git(root, "add", "README.md")
    _write_journal(root, [{"rel": "README.md", "backup": None, "tmp": None, "created": False}],
                   {"head": HEADS + "main", "commit": base, "branches": []})
    before = whole(root)
    dry = run("recover", "--dry-run", root)
    assert dry.exit_code == 0 and "would" not in dry.output, dry.output
    r = run("recover", root)
    assert r.exit_code == 0, r.output
    assert whole(root)[1] == before[1]


# --- the last and the first instants: cleaning up, and recover itself ---------------------

class _Killed(BaseException):
    """Stands for a kill -9 in-process: nothing after it runs, no handler undoes anything."""


@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_a_kill_while_cleaning_up_never_leaves_a_journal_without_its_backups(tmp_path, outcomes, monkeypatch, cmd):
    root = prepare(tmp_path, "t", cmd, True)
    before = whole(root)

    def half_rmtree(path, *args, **kwargs):  # one backup removed, then the process dies
        victim = next((p for p in sorted(Path(path).iterdir()) if p.is_file()), None)
        if victim is not None:
            victim.unlink()
        raise _Killed

    monkeypatch.setattr(write.shutil, "rmtree", half_rmtree)
    with pytest.raises(_Killed):
        {"apply": P.apply, "revert": revert.revert}[cmd](root)
    monkeypatch.undo()
    assert after_kill(root, before, outcomes[cmd, True][1], f"{cmd} killed while removing its backups") != \
        INTERRUPTED  # everything was in place: the write is done, whatever scratch is left


@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_recover_killed_at_each_of_its_steps_recovers_when_run_again(tmp_path, monkeypatch, cmd):
    """Every file restore, scratch removal and git command of recover is a kill point."""
    k = 0
    while True:
        root = prepare(tmp_path, f"k{k}", cmd, True)
        before = whole(root)
        p = start(cmd, root, {CRASH_ENV: "2"})
        assert p.wait(timeout=120) == 137
        calls = {"n": 0}

        def dying(real):
            def step(*args, **kwargs):
                if calls["n"] == k:
                    raise _Killed
                calls["n"] += 1
                return real(*args, **kwargs)
            return step

        for mod, name in ((write, "write_replace"), (write, "remove_stale"), (gittxn, "_git")):
            monkeypatch.setattr(mod, name, dying(getattr(mod, name)))
        died = False
        try:
            run("recover", root)
        except _Killed:  # BaseException: CliRunner lets it through, as a kill would end the process
            died = True
        finally:
            monkeypatch.undo()
        assert run("recover", root).exit_code == 0
        assert whole(root) == before, f"{cmd}: recover killed at its step {k}, then run again"
        if not died:
            break
        k += 1
    assert k >= 3  # restores, scratch removals and git commands were all kill points


# --- on real SGLang checkouts (opt-in, like tests/test_real_sglang.py) ---------------------

REAL_KILLS = 5


def _real_checkouts():
    from test_real_sglang import CHECKOUTS, SKIP_REASON

    return [pytest.param(c, id=Path(c).name) for c in CHECKOUTS] or [
        pytest.param(None, id="no-checkouts", marks=pytest.mark.skip(reason=SKIP_REASON))]


@pytest.mark.real_sglang
@pytest.mark.parametrize("checkout", _real_checkouts())
@pytest.mark.parametrize("cmd", ["apply", "revert"])
def test_kill_at_random_instants_on_a_real_checkout(tmp_path, checkout, cmd):
    """The issue's own trial: kill -9 at random instants on a real SGLang git checkout
    (a shared clone of it, so the checkout itself is only read)."""
    pristine = tmp_path / "pristine"
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", checkout, str(pristine)], check=True)
    git(pristine, "checkout", "-q", "--detach", git(Path(checkout), "rev-parse", "HEAD"))
    git(pristine, "switch", "-q", "-c", "main")
    git(pristine, "config", "user.name", "tester")
    git(pristine, "config", "user.email", "tester@example.com")
    if cmd == "revert":
        r = run("apply", pristine)
        assert r.exit_code == 0, r.output
    before = whole(pristine)
    golden = tmp_path / "golden"
    shutil.copytree(pristine, golden, symlinks=True)
    t0 = time.monotonic()
    p = start(cmd, golden)
    _, err = p.communicate(timeout=600)
    assert p.returncode == 0, err
    wall, after = time.monotonic() - t0, whole(golden)
    for seed in range(REAL_KILLS):
        root = tmp_path / f"k{seed}"
        shutil.copytree(pristine, root, symlinks=True)
        p = start(cmd, root)
        time.sleep(random.Random(f"real{cmd}{seed}").uniform(0.3 * wall, 1.1 * wall))
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate(timeout=60)
        after_kill(root, before, after, f"{cmd} on {Path(checkout).name} killed at random (seed {seed})")
        shutil.rmtree(root)


def test_a_stale_ref_lock_is_named_before_recover_touches_anything(tmp_path, outcomes):
    """A kill while git writes a branch (update-ref) leaves refs/heads/...lock (seen in CI's
    random kills of revert). recover's rollback would move or delete that branch, so it names
    the lock and touches nothing, as it does for index.lock; once removed, recover restores all."""
    root = prepare(tmp_path, "t", "apply", True)
    before = whole(root)
    hook_file = root / ".git" / "hooks" / "post-commit"
    hook_file.write_text(KILL_HOOK)
    hook_file.chmod(0o755)
    p = start("apply", root)
    p.communicate(timeout=120)
    assert p.returncode == -signal.SIGKILL
    hook_file.unlink()
    (branch,) = git(root, "for-each-ref", "--format=%(refname)", HEADS + BRANCH_PREFIX).split()
    lock = root / ".git" / f"{branch}.lock"
    lock.write_text("")
    killed = whole(root)
    r = run("recover", root)
    assert r.exit_code == 2 and f"{branch}.lock" in r.output and "remove it" in r.output, r.output
    assert whole(root) == killed  # no file restored, no ref moved: all of it is still to do
    lock.unlink()
    assert run("recover", root).exit_code == 0
    assert whole(root)[0] == before[0] and whole(root)[1] == before[1]


def test_a_branch_lock_no_rollback_step_writes_is_still_named(tmp_path):
    """apply killed while git created its branch leaves refs/heads/<branch>.lock; recover names it
    (seen in CI as a rare kill instant of test_kill_at_a_random_instant) instead of rolling back
    past it, so the next apply does not fail on it half-way."""
    from kvpatch.checkout.gittxn import GitUndoError, _refuse_stale_locks

    lock = tmp_path / "refs" / "heads" / "kvpatch" / "fp8-kv.lock"
    lock.parent.mkdir(parents=True)
    _refuse_stale_locks(tmp_path, [("reset", ["reset", "-q", "HEAD"])])  # no lock yet: nothing raised
    lock.write_text("")
    with pytest.raises(GitUndoError, match="fp8-kv.lock"):
        _refuse_stale_locks(tmp_path, [("reset", ["reset", "-q", "HEAD"])])


def test_the_temporary_index_lock_of_a_killed_commit_is_named(tmp_path):
    """apply killed inside its `git commit -- <paths>` leaves .git/next-index-<pid>.lock
    (seen once in a full run of test_kill_at_a_random_instant[apply-git-0]); recover
    names it, as it names index.lock, rather than roll back with it left behind."""
    from kvpatch.checkout.gittxn import GitUndoError, _refuse_stale_locks

    _refuse_stale_locks(tmp_path, [("reset", ["reset", "-q", "HEAD"])])
    (tmp_path / "next-index-4242.lock").write_text("")
    with pytest.raises(GitUndoError, match="next-index-4242.lock"):
        _refuse_stale_locks(tmp_path, [("reset", ["reset", "-q", "HEAD"])])


# --- an interrupt that lands where Python only reports exceptions ----------------------------

def _interrupt_in_a_weakref_callback(exc):
    """Raise `exc` where Python swallows it (a weakref callback: importlib's module locks
    have one, which is where GPU-less CI caught a process-group SIGINT), then run on."""
    import gc
    import weakref

    class Obj:
        pass

    def cb(_):
        raise exc

    o = Obj()
    ref = weakref.ref(o, cb)  # the callback fires when `o` dies (while `ref` lives)
    del o
    gc.collect()
    assert ref() is None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:  # the command's own code, where it must land again
        pass
    return "ran on"


@pytest.mark.parametrize("exc", [KeyboardInterrupt(), write._Interrupted("signal 15")],
                         ids=["SIGINT", "SIGTERM-while-writing"])
def test_an_interrupt_swallowed_by_a_callback_is_raised_again(exc, monkeypatch):
    """Without the hook the interrupt is lost (Python reports it, "Exception ignored in ...",
    and the command runs on to the end); with it, the interrupt lands in the command's own
    code and nothing is reported."""
    from kvpatch.__main__ import redeliver_interrupts

    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(u.exc_value))  # Python's printer
    old_term = signal.signal(signal.SIGTERM, write._raise_interrupt)
    try:
        assert _interrupt_in_a_weakref_callback(exc) == "ran on"  # swallowed
        assert reported == [exc]
        reported.clear()
        with redeliver_interrupts(), pytest.raises(type(exc)):
            _interrupt_in_a_weakref_callback(exc)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    assert reported == [] and sys.unraisablehook is not None
