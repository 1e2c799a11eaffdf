"""write: change several files so that a checkout is all-old or all-new.

POSIX renames are atomic one file at a time, so a set of writes is made
recoverable instead: a journal is written first (with where git's HEAD was),
then every new file is staged next to its target and every old one copied
aside, then the targets are replaced and the git steps run. An exception,
Ctrl-C or SIGTERM rolls back at once; a kill -9 leaves the journal, which
``status`` reports and only ``kvpatch recover`` rolls back (files, then refs
and index through gittxn), since a journal may come with a cloned fork.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, List, Optional

from kvpatch.checkout import gittxn
from kvpatch.names import TXN_DIR
from kvpatch.checkout.safepath import (UnsafePath, create_new, inside, is_link, read_regular, remove_stale,
                              tmp_path, under, write_replace)
from kvpatch.names import JOURNAL_FILE
from kvpatch.checkout.state import STATE_DIR, sha256, write_json_atomic

GIT_KEY = "git"  # the journal's record of HEAD before the write (gittxn.record)
# Journal phases: while staging, no target has been touched yet.
PHASE_STAGING = "staging"
PHASE_REPLACING = "replacing"
# Test hook: exit hard after this many replacements (simulates kill -9).
CRASH_ENV = "KVPATCH_TEST_CRASH_AFTER"
# Test hook: after this many replacements, say so on stderr and sleep (a test
# then sends SIGINT or SIGTERM: the write must roll back).
PAUSE_ENV = "KVPATCH_TEST_PAUSE_AFTER"


class WriteError(Exception):
    pass


@dataclass
class FileWrite:
    rel: str
    data: Optional[bytes]  # None: delete the file


def preflight(root: Path, writes: List[FileWrite]) -> List[str]:
    """Reasons the writes cannot all be done; empty when they can."""
    problems, seen = [], set()
    if hasattr(os, "statvfs") and os.statvfs(root).f_flag & os.ST_RDONLY:  # a read-only mount: one line
        return [f"{root}: is on a read-only filesystem"]
    for d in (STATE_DIR, f"{STATE_DIR}/{TXN_DIR}"):
        if is_link(root / d):
            problems.append(f"{d}: is a symbolic link; kvpatch does not write through links")
    for w in writes:
        try:
            p = inside(root, w.rel, "write")
        except UnsafePath as exc:
            problems.append(str(exc))
            continue
        if is_link(p):
            problems.append(f"{w.rel}: is a symbolic link; kvpatch does not write through links")
            continue
        if p.exists():
            # The mode bits too: root may write anything, but a file made
            # read-only was made so on purpose.
            if not p.stat().st_mode & 0o222:
                problems.append(f"{w.rel}: is read-only")
            elif not os.access(p, os.W_OK):  # write bits, yet no write: an immutable file (chattr +i)
                problems.append(f"{w.rel}: cannot be written (immutable, or not this user's to write)")
        d = next(a for a in (p.parent, *p.parent.parents) if a.exists() or a == root)
        if (not os.access(d, os.W_OK) or not d.stat().st_mode & 0o222) and f"{d}" not in seen:  # root too
            seen.add(f"{d}")
            problems.append(f"{w.rel}: directory {d} is not writable")
    return problems


def journal_path(root: Path) -> Path:
    return root / STATE_DIR / JOURNAL_FILE


def pending(root: Path) -> Optional[dict]:
    """The journal of an interrupted write, if any (a link or a FIFO in its place,
    or a journal that does not parse, is reported as corrupt, never followed)."""
    jp = journal_path(root)
    if not jp.exists() and not is_link(jp):
        return None
    try:
        return json.loads(read_regular(jp).decode("utf-8"))
    except (ValueError, OSError) as exc:
        return {"op": "unknown", "files": [], "corrupt": f"{exc}"}


def check_journal(root: Path, j: dict) -> None:
    """Every path of a journal: inside the root, through no link, each of the
    shape kvpatch writes (backups under .kvpatch/txn/, the temp file next to its
    target). A journal that fails is refused whole: a cloned fork may ship one."""
    if j.get("corrupt"):
        raise UnsafePath(f"{journal_path(root)} is unreadable ({j['corrupt']})")
    if is_link(root / STATE_DIR) or is_link(root / STATE_DIR / TXN_DIR):
        raise UnsafePath(f"{STATE_DIR} or {STATE_DIR}/{TXN_DIR} is a symbolic link")
    files, dirs = j.get("files"), j.get("created_dirs", [])
    if not isinstance(files, list) or not isinstance(dirs, list):
        raise UnsafePath("the journal's files or created_dirs is not a list")
    for f in files:
        if not isinstance(f, dict):
            raise UnsafePath("a journal entry is not an object")
        rel = f.get("rel")
        inside(root, rel, "journal file")
        if f.get("backup") is not None:
            inside(root, under(f["backup"], f"{STATE_DIR}/{TXN_DIR}", "journal backup"), "journal backup")
        if f.get("tmp") is not None:
            want = tmp_path(Path(rel)).as_posix()
            if f["tmp"] != want:
                raise UnsafePath(f"journal temp file {f['tmp']!r} is not {want!r}")
            inside(root, f["tmp"], "journal temp file")
        if f.get("mode") is not None and (not isinstance(f["mode"], int) or not 0 <= f["mode"] <= 0o7777):
            raise UnsafePath(f"journal mode {f['mode']!r} of {rel!r} is not a permission mode")
    for d in dirs:
        inside(root, d, "journal directory")
    if j.get(GIT_KEY) is not None:
        gittxn.check(j[GIT_KEY])


def _git_steps(root: Path, j: dict):
    """The git commands that undo the journal's git steps (none without a git record)."""
    if j.get(GIT_KEY) is None:
        return []
    return gittxn.plan(root, j[GIT_KEY], j["files"])


def plan_rollback(root: Path, j: dict) -> List[str]:
    """What rolling `j` back will do, one line each (`kvpatch recover` shows it first)."""
    check_journal(root, j)
    lines = []
    staging = j.get("phase") == PHASE_STAGING
    for f in j.get("files", []):
        target = root / f["rel"]
        if staging:
            pass
        elif f.get("backup") and (root / f["backup"]).exists():
            lines.append(f"restore {f['rel']} from {f['backup']}")
        elif f.get("created") and (target.exists() or is_link(target)):
            lines.append(f"remove {f['rel']} (created by the interrupted write)")
        if f.get("tmp") and ((root / f["tmp"]).exists() or is_link(root / f["tmp"])):
            lines.append(f"remove {f['tmp']}")
    return lines + [what for what, _ in _git_steps(root, j)]


def rollback(root: Path) -> List[str]:
    """Undo an interrupted write from its journal; returns the files restored.
    Raises UnsafePath, touching nothing, on a journal that fails check_journal."""
    j = pending(root)
    if j is None:
        return []
    check_journal(root, j)
    # Asked before any file is touched: a git side that cannot be undone now
    # (a stale index.lock) leaves everything, journal included, for a later recover.
    git_steps = _git_steps(root, j)
    restored = []
    staging = j.get("phase") == PHASE_STAGING  # no target touched yet
    for f in j.get("files", []):
        target = root / f["rel"]
        tmp = root / f["tmp"] if f.get("tmp") else None
        if staging:
            pass
        elif f.get("backup"):
            backup = root / f["backup"]
            if backup.exists():
                # revert prunes the emptied .kvpatch/originals/ folders before its
                # commit: a kill after that finds the restored copy's folder gone.
                target.parent.mkdir(parents=True, exist_ok=True)
                write_replace(target, read_regular(backup), f.get("mode"))
                restored.append(f["rel"])
        elif f.get("created") and (target.exists() or is_link(target)):
            target.unlink()
            restored.append(f["rel"])
        if tmp is not None:
            remove_stale(tmp)
    _remove_dirs(root, j.get("created_dirs", []))
    gittxn.undo(root, git_steps)  # before the journal goes: a kill here leaves it to recover again
    _cleanup(root)
    return restored


def stale_scratch(root: Path) -> List[str]:
    """What a write killed outside its journal's lifetime leaves, with no journal:
    .kvpatch/txn/ (killed after the journal went), the journal's temp file or an
    empty .kvpatch/ (killed before the first journal was in place). Nothing in
    them is needed: no target was touched, or every one was finished."""
    if pending(root) is not None:
        return []
    sd = root / STATE_DIR
    found = [p for p in (sd / TXN_DIR, tmp_path(journal_path(root))) if p.exists() or is_link(p)]
    if not found and sd.is_dir() and not is_link(sd) and not any(sd.iterdir()):
        found.append(sd)
    return [p.relative_to(root).as_posix() for p in found]


def clear_stale(root: Path) -> List[str]:
    """Remove stale_scratch(root); returns what was removed."""
    found = stale_scratch(root)
    if found:
        _cleanup(root)
    return found


def _remove_dirs(root: Path, dirs: List[str]) -> None:
    """Remove the (now empty) directories a write made, deepest first."""
    for extra in sorted(set(dirs), key=lambda d: d.count("/"), reverse=True):
        try:
            (root / extra).rmdir()
        except OSError:
            pass


def _cleanup(root: Path) -> None:
    # The journal goes first: removing it is the commit point. A kill while the
    # backups are being removed must not leave a journal whose backups are half
    # gone (recover would then restore some files and not others); a txn/ left
    # without its journal is stale, and the next write clears it.
    jp = journal_path(root)
    for j in (jp, tmp_path(jp)):  # the temp file: a journal write cut short
        remove_stale(j)
    txn = root / STATE_DIR / TXN_DIR
    if is_link(txn):
        txn.unlink()  # the link only: never what it points to
    elif txn.exists():
        shutil.rmtree(txn, ignore_errors=True)
    sd = root / STATE_DIR
    if sd.exists() and not any(sd.iterdir()):
        sd.rmdir()


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt: the write rolls back and the CLI
    reports it like Ctrl-C (one line, exit 130) instead of a traceback.
    `signum` lets kvpatch.__main__ raise it again where it was swallowed."""

    signum = signal.SIGTERM


def _raise_interrupt(signum, frame):  # pragma: no cover - signal path
    raise _Interrupted(f"signal {signum}")


def _test_pause(n: int) -> None:  # pragma: no cover - exercised in a subprocess
    import sys
    import time

    sys.stderr.write(f"kvpatch-test: paused after {n} replacement(s)\n")
    sys.stderr.flush()
    time.sleep(60)


def apply_writes(root: Path, writes: List[FileWrite], op: str,
                 before_finish: Optional[Callable[[], None]] = None, git: Optional[dict] = None) -> None:
    """Write all files or none. `before_finish` (e.g. the git commit) runs
    after every file is in place; if it raises, everything is rolled back,
    and with `git` (gittxn.record, taken before any git step) the refs and
    the index too."""
    problems = preflight(root, writes)
    if problems:
        raise WriteError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
    if pending(root) is not None:
        raise WriteError("an interrupted kvpatch write is pending: run `kvpatch recover` first")
    # SIGTERM interrupts like Ctrl-C from here on, staging included: a kill
    # while staging must not leave *.kvpatch-tmp files behind either.
    old_int = signal.getsignal(signal.SIGINT)
    try:
        old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    except ValueError:  # not the main thread
        old_term = old_int = None
    try:
        _stage_and_replace(root, writes, op, before_finish, git)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)


def _plan_entries(root: Path, writes: List[FileWrite]):
    """The journal entries and the directories to make, decided before any IO."""
    txn_rel = f"{STATE_DIR}/{TXN_DIR}"
    entries, created_dirs = [], []
    if not (root / STATE_DIR).exists():
        created_dirs.append(STATE_DIR)
    for i, w in enumerate(writes):
        target = inside(root, w.rel, "write")
        exists = target.exists()
        entry = {"rel": w.rel, "backup": f"{txn_rel}/{i}.orig" if exists else None, "tmp": None,
                 "created": not exists, "mode": stat.S_IMODE(target.stat().st_mode) if exists else None}
        if w.data is not None:
            d = target.parent
            while not d.exists() and d != root:  # every directory made, not just the deepest
                rel = d.relative_to(root).as_posix()
                if rel not in created_dirs:
                    created_dirs.append(rel)
                d = d.parent
            entry["tmp"] = tmp_path(target).relative_to(root).as_posix()
            entry["new_sha256"] = sha256(w.data)
        entries.append(entry)
    return entries, created_dirs


def _journal(root: Path, op: str, phase: str, entries, created_dirs, git: Optional[dict]) -> None:
    write_json_atomic(journal_path(root), json.dumps(
        {"op": op, "phase": phase, "files": entries, "created_dirs": created_dirs, GIT_KEY: git}, indent=2))


def _stage_and_replace(root: Path, writes: List[FileWrite], op: str,
                       before_finish: Optional[Callable[[], None]], git: Optional[dict]) -> None:
    # The journal exists before the first byte is staged (phase "staging": a kill
    # then leaves targets untouched, and recover only removes the scratch files),
    # and is rewritten as "replacing" once every backup and temp file is complete.
    entries, created_dirs = _plan_entries(root, writes)
    txn = root / STATE_DIR / TXN_DIR
    try:
        (root / STATE_DIR).mkdir(exist_ok=True)
        if txn.exists():  # a stale one (its journal is gone): nothing in it is needed
            shutil.rmtree(txn)
        _journal(root, op, PHASE_STAGING, entries, created_dirs, git)
        txn.mkdir()
        for w, e in zip(writes, entries):
            target = root / w.rel
            if e["backup"]:
                create_new(root / e["backup"], read_regular(target))
            if w.data is not None:
                target.parent.mkdir(parents=True, exist_ok=True)
                remove_stale(root / e["tmp"])  # a planted link is removed, never written through
                create_new(root / e["tmp"], w.data, e["mode"])
        _journal(root, op, PHASE_REPLACING, entries, created_dirs, git)
    except BaseException:
        for e in entries:
            if e.get("tmp"):
                remove_stale(root / e["tmp"])
        _cleanup(root)
        _remove_dirs(root, created_dirs)
        raise

    crash_after = int(os.environ.get(CRASH_ENV, "-1"))
    pause_after = int(os.environ.get(PAUSE_ENV, "-1"))
    try:
        for n, (w, e) in enumerate(zip(writes, entries)):
            if crash_after == n:
                os._exit(137)
            if pause_after == n:
                _test_pause(n)
            target = root / w.rel
            if w.data is None:
                if target.exists():
                    target.unlink()
            else:
                os.replace(root / e["tmp"], target)
        if crash_after == len(writes):
            os._exit(137)
        if pause_after == len(writes):
            _test_pause(len(writes))
        if before_finish is not None:
            before_finish()
    except BaseException:
        rollback(root)
        raise
    _cleanup(root)
