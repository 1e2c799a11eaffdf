"""write: change several files so that a checkout is all-old or all-new.

POSIX renames are atomic one file at a time, so a set of writes is made
recoverable instead: every new file is staged next to its target and every
old one copied aside, then a journal is written, then the targets are
replaced. An exception, Ctrl-C or SIGTERM while replacing rolls back at once;
a kill -9 leaves the journal, which ``status`` reports and the next
``apply``/``revert``/``recover`` rolls back before doing anything else.
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

from kvpatch.state import JOURNAL_FILE, STATE_DIR, sha256, write_json_atomic

TXN_DIR = "txn"
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


def _fsync_write(path: Path, data: bytes, mode: Optional[int] = None) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    if mode is not None:
        os.chmod(path, mode)


def preflight(root: Path, writes: List[FileWrite]) -> List[str]:
    """Reasons the writes cannot all be done; empty when they can."""
    problems = []
    for w in writes:
        p = root / w.rel
        if p.is_symlink():
            problems.append(f"{w.rel}: is a symbolic link; kvpatch does not write through links")
            continue
        if p.exists():
            # The mode bits too: root may write anything, but a file made
            # read-only was made so on purpose.
            if not os.access(p, os.W_OK) or not p.stat().st_mode & 0o222:
                problems.append(f"{w.rel}: is read-only")
        if not os.access(p.parent if p.parent.exists() else root, os.W_OK):
            problems.append(f"{w.rel}: directory {p.parent} is not writable")
    return problems


def journal_path(root: Path) -> Path:
    return root / STATE_DIR / JOURNAL_FILE


def pending(root: Path) -> Optional[dict]:
    """The journal of an interrupted write, if any."""
    jp = journal_path(root)
    if not jp.exists():
        return None
    try:
        return json.loads(jp.read_text(encoding="utf-8"))
    except ValueError:
        return {"op": "unknown", "files": [], "corrupt": True}


def rollback(root: Path) -> List[str]:
    """Undo an interrupted write from its journal; returns the files restored."""
    j = pending(root)
    if j is None:
        return []
    restored = []
    for f in j.get("files", []):
        target = root / f["rel"]
        tmp = root / f["tmp"] if f.get("tmp") else None
        if f.get("backup"):
            backup = root / f["backup"]
            if backup.exists():
                mode = f.get("mode")
                shutil.copyfile(backup, target)
                if mode is not None:
                    os.chmod(target, mode)
                restored.append(f["rel"])
        elif f.get("created") and target.exists():
            target.unlink()
            restored.append(f["rel"])
        if tmp is not None and tmp.exists():
            tmp.unlink()
    _remove_dirs(root, j.get("created_dirs", []))
    _cleanup(root)
    return restored


def _remove_dirs(root: Path, dirs: List[str]) -> None:
    """Remove the (now empty) directories a write made, deepest first."""
    for extra in sorted(set(dirs), key=lambda d: d.count("/"), reverse=True):
        try:
            (root / extra).rmdir()
        except OSError:
            pass


def _cleanup(root: Path) -> None:
    txn = root / STATE_DIR / TXN_DIR
    if txn.exists():
        shutil.rmtree(txn, ignore_errors=True)
    jp = journal_path(root)
    for j in (jp, jp.with_name(jp.name + ".tmp")):  # .tmp: a journal write cut short
        if j.exists():
            j.unlink()
    sd = root / STATE_DIR
    if sd.exists() and not any(sd.iterdir()):
        sd.rmdir()


class _Interrupted(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt: the write rolls back and the CLI
    reports it like Ctrl-C (one line, exit 130) instead of a traceback."""


def _raise_interrupt(signum, frame):  # pragma: no cover - signal path
    raise _Interrupted(f"signal {signum}")


def _test_pause(n: int) -> None:  # pragma: no cover - exercised in a subprocess
    import sys
    import time

    sys.stderr.write(f"kvpatch-test: paused after {n} replacement(s)\n")
    sys.stderr.flush()
    time.sleep(60)


def apply_writes(root: Path, writes: List[FileWrite], op: str,
                 before_finish: Optional[Callable[[], None]] = None) -> None:
    """Write all files or none. `before_finish` (e.g. the git commit) runs
    after every file is in place; if it raises, everything is rolled back."""
    problems = preflight(root, writes)
    if problems:
        raise WriteError("; ".join(problems))
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
        _stage_and_replace(root, writes, op, before_finish)
    finally:
        if old_term is not None:
            signal.signal(signal.SIGTERM, old_term)
        if old_int is not None:
            signal.signal(signal.SIGINT, old_int)


def _stage_and_replace(root: Path, writes: List[FileWrite], op: str,
                       before_finish: Optional[Callable[[], None]]) -> None:
    txn = root / STATE_DIR / TXN_DIR
    entries = []
    created_dirs = []
    try:
        if not (root / STATE_DIR).exists():
            created_dirs.append(STATE_DIR)
        txn.mkdir(parents=True, exist_ok=True)
        for i, w in enumerate(writes):
            target = root / w.rel
            entry = {"rel": w.rel, "backup": None, "tmp": None, "created": not target.exists(), "mode": None}
            if target.exists():
                mode = stat.S_IMODE(target.stat().st_mode)
                backup = txn / f"{i}.orig"
                shutil.copyfile(target, backup)
                entry["backup"] = backup.relative_to(root).as_posix()
                entry["mode"] = mode
            if w.data is not None:
                parent = target.parent
                if not parent.exists():
                    d = parent
                    while not d.exists():  # every directory made, not just the deepest
                        created_dirs.append(d.relative_to(root).as_posix())
                        d = d.parent
                    parent.mkdir(parents=True)
                tmp = target.with_name(f".{target.name}.kvpatch-tmp")
                entry["tmp"] = tmp.relative_to(root).as_posix()
                entries.append(entry)  # before the write: a half-written tmp is removed too
                _fsync_write(tmp, w.data, entry["mode"])
                entry["new_sha256"] = sha256(w.data)
            else:
                entries.append(entry)
        write_json_atomic(journal_path(root), json.dumps(
            {"op": op, "files": entries, "created_dirs": created_dirs}, indent=2))
    except BaseException:
        for e in entries:
            if e.get("tmp") and (root / e["tmp"]).exists():
                (root / e["tmp"]).unlink()
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
