"""status: is a checkout not patched, patched, partly patched, drifted, or
left half-written by an interrupted apply? Answered from the state record,
the files' hashes and a fresh scan; no git needed."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import List, Optional

from kvpatch.checkout import recognise
from kvpatch.checkout import lock
from kvpatch.checkout import write
from kvpatch.engine import scan_tree
from kvpatch.output.exitcodes import EXIT_ACTION, EXIT_DRIFT, EXIT_ERROR, EXIT_INTERRUPTED, EXIT_OK
from kvpatch.runtime import runtime_version
from kvpatch.sites import NEEDS_ACTION, PLAN_REWRITE, PlanCall
from kvpatch.checkout.safepath import is_link, read_regular
from kvpatch.checkout.state import declined_key, load, sha256

NOT_PATCHED = "not patched"
PATCHED = "patched"
PARTLY = "partly patched"
DRIFTED = "drifted"
INTERRUPTED = "interrupted"
IN_PROGRESS = "in progress"  # a journal, and its writer still holds the lock
NOTHING = "nothing to patch"


@dataclass
class Place:
    file: str
    what: str
    line: Optional[int] = None


@dataclass
class Status:
    state: str
    places: List[Place] = field(default_factory=list)
    detail: str = ""
    # Files the scan could not read or parse: their sites are unknown, so the
    # answer is incomplete (exit 2) unless drift or an interrupted write says more.
    errors: List[Place] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.errors and self.state not in (DRIFTED, INTERRUPTED, IN_PROGRESS):
            return EXIT_ERROR
        return {PATCHED: EXIT_OK, NOTHING: EXIT_OK, NOT_PATCHED: EXIT_ACTION, PARTLY: EXIT_ACTION,
                DRIFTED: EXIT_DRIFT, INTERRUPTED: EXIT_INTERRUPTED, IN_PROGRESS: EXIT_INTERRUPTED}[self.state]

    def to_dict(self):
        return {"schema": "kvpatch.status/1", "state": self.state, "detail": self.detail,
                "exit_code": self.exit_code, "places": [asdict(p) for p in self.places],
                "errors": [asdict(p) for p in self.errors]}


def _unindented(text: str) -> str:
    return "\n" + "\n".join(line.strip() for line in text.splitlines()) + "\n"


def status(root: Path, select=None, excluded=None) -> Status:
    return _status(root.resolve(), select, excluded)


def _status(root: Path, select=None, excluded=None) -> Status:
    j = write.pending(root)
    if j is not None and lock.held(root):
        return Status(IN_PROGRESS, [], f"a `kvpatch {j.get('op', '?')}` is writing to this checkout now; "
                                       f"ask again when it is done")
    if j is not None:
        files = [f.get("rel", "?") if isinstance(f, dict) else "?" for f in j.get("files", [])]
        return Status(INTERRUPTED, [Place(f, "listed in the interrupted write's journal") for f in files],
                      f"an interrupted `kvpatch {j.get('op', '?')}` left {len(files)} file(s) in an unknown state; "
                      f"`kvpatch recover` rolls them back (`--dry-run` shows how)")
    st = load(root)
    scan = scan_tree(root, select, excluded=excluded)
    errors = [Place(e.file, e.message, e.line) for e in scan.all_errors]
    found = _verdict(root, st, scan)
    found.errors = errors
    return found


def _verdict(root: Path, st, scan) -> Status:
    fixable = [s for s in scan.sites if s.fixable] + [p for p in scan.plans if p.status == PLAN_REWRITE]
    if st is None:
        unrec = recognise.unrecorded(scan, fixable)  # rewrites in the files: never "not patched" (issue 18)
        if unrec is not None:
            return Status(unrec[0], [Place(*p) for p in unrec[1]], unrec[2])
        if fixable:
            return Status(NOT_PATCHED, [Place(r.file, f"{r.qualname}: {r.status}", r.line) for r in fixable],
                          f"{len(fixable)} site(s) and plan call(s) that apply would rewrite")
        hot = [s for s in scan.sites if s.status in NEEDS_ACTION]
        if hot:
            return Status(NOT_PATCHED, [Place(s.file, f"{s.qualname}: {s.status}", s.line) for s in hot],
                          "hot sites that no rule rewrites")
        return Status(NOTHING, [], "no site that kvpatch rewrites")

    drift: List[Place] = []
    missing: List[Place] = []
    for f in st.files:
        p = root / f.path
        if not p.exists():
            missing.append(Place(f.path, "patched file is gone"))
            continue
        try:
            cur = read_regular(p)
        except OSError as exc:  # UnsafePath too: a FIFO or link where the file was
            drift.append(Place(f.path, f"cannot read the patched file: {exc}"))
            continue
        h = sha256(cur)
        if h == f.patched_sha256:
            continue
        if h == f.original_sha256:
            missing.append(Place(f.path, "back to the original bytes (patch removed by hand)"))
            continue
        # state.json keeps each rewritten statement dedented; the file has it indented
        # (and maybe with CRLF): compare line by line without the indentation, so an
        # edit elsewhere in the file is not drift.
        text = _unindented(cur.decode("utf-8", errors="replace"))
        for s in f.sites:
            for stmt in ([s.rewritten] if s.rewritten else []) + list(s.also):
                if _unindented(stmt) not in text:
                    what = f"the rewritten {s.kind}" if stmt is s.rewritten else "a call its rewrite routed"
                    drift.append(Place(f.path, f"{s.qualname}: {what} was edited "
                                               f"(expected `{stmt.splitlines()[0].strip()}`)", s.line))
                    break
    for r in st.runtime_files:
        p = root / r.path
        if not p.exists():
            missing.append(Place(r.path, "runtime module is missing"))
        elif is_link(p) or not p.is_file() or sha256(read_regular(p)) != r.sha256:
            drift.append(Place(r.path, "runtime module was edited or replaced"))
    fixable, declined = _declined(st, fixable)
    if drift:
        return Status(DRIFTED, drift + missing, "patched regions were edited since apply")
    if missing or fixable:
        return Status(PARTLY, missing + [Place(x.file, f"{x.qualname}: not rewritten yet", x.line) for x in fixable],
                      "some recorded rewrites are gone or new sites appeared; `kvpatch apply` completes it")
    detail = f"kvpatch {st.kvpatch_version}, ruleset {st.ruleset_version}, runtime {st.runtime_version}"
    if st.runtime_version != runtime_version():
        detail += f" (this kvpatch ships runtime {runtime_version()}: apply updates it)"
    if declined:
        casts = sum(1 for r in declined if not isinstance(r, PlanCall))
        what = f"{casts} site(s)" + (f" and {len(declined) - casts} plan call(s)" if len(declined) > casts else "")
        detail = f"{what} declined at `kvpatch apply -i` (a plain `kvpatch apply` rewrites them); " + detail
    return Status(PATCHED, [Place(r.file, f"{r.qualname}: declined", r.line) for r in declined], detail)


def _declined(st, fixable):
    """(still to do, declined): the fixable records that apply -i was told to leave are not missing."""
    left = Counter(d.key for d in st.declined)
    todo, declined = [], []
    for r in fixable:
        k = declined_key(r)
        if left[k] > 0:
            left[k] -= 1
            declined.append(r)
        else:
            todo.append(r)
    return todo, declined
