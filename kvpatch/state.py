"""state: what a patched checkout records about its patch.

``.kvpatch/state.json`` holds the kvpatch, ruleset and runtime versions, the
upstream commit, and for every rewritten file its original and patched hashes
and the original and rewritten text of every site; ``.kvpatch/originals/``
holds byte-exact copies of the original files. ``status``, ``revert``,
``verify`` and the upgrade audit work from these, with or without git.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

STATE_DIR = ".kvpatch"
STATE_FILE = "state.json"
JOURNAL_FILE = "journal.json"
ORIGINALS = "originals"
SCHEMA = "kvpatch.state/1"


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


@dataclass
class FileRecord:
    path: str
    original_sha256: str
    patched_sha256: str
    original_copy: str
    sites: List[SiteRecord] = field(default_factory=list)


@dataclass
class RuntimeRecord:
    path: str
    sha256: str
    created: bool  # False: it replaced an older runtime, kept in originals
    original_copy: Optional[str] = None


@dataclass
class State:
    kvpatch_version: str
    ruleset_version: str
    runtime_version: str
    applied_at: str
    upstream: Dict[str, Optional[str]]
    branch: Optional[str]
    files: List[FileRecord] = field(default_factory=list)
    runtime_files: List[RuntimeRecord] = field(default_factory=list)
    schema: str = SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False) + "\n"

    @classmethod
    def from_dict(cls, d: Dict) -> "State":
        if d.get("schema") != SCHEMA:
            raise ValueError(f"unknown state schema {d.get('schema')!r} (expected {SCHEMA})")
        files = [FileRecord(**{**f, "sites": [SiteRecord(**s) for s in f.get("sites", [])]}) for f in d["files"]]
        rts = [RuntimeRecord(**r) for r in d.get("runtime_files", [])]
        rest = {k: v for k, v in d.items() if k not in ("files", "runtime_files")}
        return cls(files=files, runtime_files=rts, **rest)


def state_dir(root: Path) -> Path:
    return root / STATE_DIR


def load(root: Path) -> Optional[State]:
    p = state_dir(root) / STATE_FILE
    if not p.exists():
        return None
    try:
        return State.from_dict(json.loads(p.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{p}: unreadable kvpatch state ({exc})") from exc


def original_bytes(root: Path, rec: FileRecord) -> bytes:
    return (root / rec.original_copy).read_bytes()


def write_json_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
