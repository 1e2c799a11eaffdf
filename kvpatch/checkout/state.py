"""state: what a patched checkout records about its patch.

``.kvpatch/state.json`` holds the kvpatch, ruleset and runtime versions, the
upstream commit, and for every rewritten file its original and patched hashes
and the original and rewritten text of every site. Each original is found in
git (``original_commit``: the commit apply started from, read with checkout
filters) where git gives back exactly its bytes, and is otherwise kept as a
byte-exact copy under ``.kvpatch/originals/`` (no git, untracked or dirty
files). ``status``, ``revert``, ``verify`` and the upgrade audit work from
these, with or without git. ``declined`` (only when there are some) lists the
sites ``apply -i`` was told to leave, which ``status`` then does not count as
missing.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Dict, List, Optional

from kvpatch.sites import PlanCall
from kvpatch.checkout.safepath import UnsafePath, inside, is_link, read_regular, under, write_replace

from kvpatch.names import ORIGINALS, STATE_DIR, STATE_FILE
SCHEMA = "kvpatch.state/1"
MAX_STATE_BYTES = 64 << 20
_COMMIT = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass
class SiteRecord:
    qualname: str
    rule: str
    kind: str  # cast | plan
    line: int  # in the patched file
    original: str  # the statement before
    rewritten: str  # the statement after
    # Other statements the rewrite changed for this site (a routed kernel call), as
    # after; written only when there are some, so other records read as before.
    also: List[str] = field(default_factory=list)


@dataclass
class DeclinedRecord:
    """A site or plan call `kvpatch apply -i` was told to leave (answer n):
    status does not count it as missing; a later plain apply rewrites it."""

    file: str
    kind: str  # cast | plan
    qualname: str
    rule: str
    line: int  # where it was when declined
    statement: str  # its statement then, which identifies it (lines move)

    @classmethod
    def of(cls, rec) -> "DeclinedRecord":
        kind = "plan" if isinstance(rec, PlanCall) else "cast"
        return cls(rec.file, kind, rec.qualname, rec.rule or "", rec.line, rec.statement)

    @property
    def key(self) -> tuple:
        return self.file, self.kind, self.qualname, self.rule, self.statement


def declined_key(rec) -> tuple:
    """A Site's or PlanCall's identity, as DeclinedRecord.key spells it."""
    return DeclinedRecord.of(rec).key


@dataclass
class FileRecord:
    path: str
    original_sha256: str
    patched_sha256: str
    original_copy: Optional[str]  # None: the original is in git at original_commit
    sites: List[SiteRecord] = field(default_factory=list)
    original_commit: Optional[str] = None


@dataclass
class RuntimeRecord:
    path: str
    sha256: str
    created: bool  # False: it replaced an older runtime, kept as originals are
    original_copy: Optional[str] = None
    original_commit: Optional[str] = None
    original_sha256: Optional[str] = None


@dataclass
class State:
    kvpatch_version: str
    ruleset_version: str
    runtime_version: str
    applied_at: str
    upstream: Dict[str, Optional[str]]
    files: List[FileRecord] = field(default_factory=list)
    runtime_files: List[RuntimeRecord] = field(default_factory=list)
    schema: str = SCHEMA
    declined: List[DeclinedRecord] = field(default_factory=list)  # apply -i's "no" answers

    def to_json(self) -> str:
        d = asdict(self)
        if not self.declined:  # the record of a plain apply stays as before
            del d["declined"]
        for f in d["files"]:
            for site in f["sites"]:
                if not site["also"]:
                    del site["also"]
        return json.dumps(d, indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: Dict) -> "State":
        if d.get("schema") != SCHEMA:
            raise ValueError(f"unknown state schema {d.get('schema')!r} (expected {SCHEMA})")
        known = {f.name for f in fields(SiteRecord)}  # a later kvpatch's extra keys are not ours to read
        files = [FileRecord(**{**f, "sites": [SiteRecord(**{k: v for k, v in s.items() if k in known})
                                              for s in f.get("sites", [])]}) for f in d["files"]]
        rts = [RuntimeRecord(**r) for r in d.get("runtime_files", [])]
        declined = [DeclinedRecord(**x) for x in d.get("declined", [])]
        # "branch": always null, written by earlier kvpatch and never read: skipped.
        rest = {k: v for k, v in d.items() if k not in ("files", "runtime_files", "declined", "branch")}
        return cls(files=files, runtime_files=rts, declined=declined, **rest)


def state_dir(root: Path) -> Path:
    return root / STATE_DIR


def load(root: Path) -> Optional[State]:
    """The recorded state, or None. A state that names a path outside the checkout,
    through a link, or a link where the state lives, is refused (ValueError, one
    line) before anything reads or writes what it names: a cloned fork may ship one."""
    d = state_dir(root)
    p = d / STATE_FILE
    if is_link(d) or is_link(p):
        raise UnsafePath(f"{p}: {STATE_DIR} or its state file is a symbolic link; refusing to use it")
    if not p.exists():
        return None
    try:
        if p.stat().st_size > MAX_STATE_BYTES:  # committed (issue 18): a clone's record is read bounded
            raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
        st = State.from_dict(json.loads(read_regular(p).decode("utf-8")))
        validate(root, st)
        return st
    except UnsafePath as exc:
        raise UnsafePath(f"{p}: unsafe kvpatch state, nothing was touched ({exc})") from exc
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise ValueError(f"{p}: unreadable kvpatch state ({exc})") from exc


def validate(root: Path, st: State) -> None:
    """Every path the state names: a checkout file outside .kvpatch/, or a copy under
    .kvpatch/originals/, reached through no symbolic link; every commit a full hex id."""
    originals = f"{STATE_DIR}/{ORIGINALS}"
    for what, rel, copy, commit in ([("patched file", f.path, f.original_copy, f.original_commit)
                                     for f in st.files]
                                    + [("runtime file", r.path, r.original_copy, r.original_commit)
                                       for r in st.runtime_files]):
        inside(root, rel, what)
        if rel == STATE_DIR or rel.startswith(STATE_DIR + "/"):
            raise UnsafePath(f"{what}: {rel!r} is inside {STATE_DIR}/")
        check_commit(commit, rel)
        if copy is not None or (what == "patched file" and commit is None):
            inside(root, under(copy, originals, f"original copy of {rel}"), f"original copy of {rel}")


def check_commit(commit, rel: str) -> None:
    """An original's commit: None or a full hex commit id (never an option or a revision expression)."""
    if commit is not None and not (isinstance(commit, str) and _COMMIT.fullmatch(commit)):
        raise UnsafePath(f"original commit of {rel}: {commit!r} is not a commit id")


def write_json_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_replace(path, text.encode("utf-8"))
