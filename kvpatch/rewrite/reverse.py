"""reverse: undo kvpatch's rewrite in a file the user has edited since apply.

`revert` restores a file byte for byte when it is exactly what apply wrote.
When the user edited it elsewhere since (a comment, an unrelated fix), the
rewrite is taken back hunk by hunk instead, as `git revert` would: each block
that apply changed, with its unchanged context lines, must appear exactly once
in the current file, and is put back as it was. The user's other edits stay.
A hunk that is not found exactly once (an edit inside a patched region or next
to it) makes the whole file fall back to drift: nothing half-reverted.

The patched text is not stored; it is rebuilt from the original with the rules
and must hash to what the state recorded, or the reverse is not attempted.
"""

from __future__ import annotations

import difflib
import hashlib
from typing import List, Optional, Sequence

from kvpatch.engine import analyze_source
from kvpatch.rewrite.transform import RewriteError, plan_rewrite
from kvpatch.rule import load_rules

CONTEXT_LINES = 3  # unchanged lines kept around each hunk to place it (as diff -U3)


def rebuild_patched(rel: str, original: bytes, patched_sha256: str,
                    selections: Sequence[Optional[Sequence[str]]] = (None,)) -> Optional[bytes]:
    """What apply wrote for `original`, if this kvpatch rebuilds it exactly."""
    for select in selections:
        rules = load_rules(select)
        try:
            rw = plan_rewrite(analyze_source(rel, original, rules), rules)
        except (RewriteError, SyntaxError, ValueError):
            continue
        if rw is not None and hashlib.sha256(rw.new_bytes).hexdigest() == patched_sha256:
            return rw.new_bytes
    return None


def _find_once(lines: List[bytes], block: List[bytes]) -> Optional[int]:
    if not block:
        return None
    hits = [i for i in range(len(lines) - len(block) + 1) if lines[i:i + len(block)] == block]
    return hits[0] if len(hits) == 1 else None


def reverse_patch(current: bytes, patched: bytes, original: bytes) -> Optional[bytes]:
    """`current` with the patched -> original change applied; None if any hunk
    cannot be placed exactly once."""
    p_lines = patched.splitlines(keepends=True)
    o_lines = original.splitlines(keepends=True)
    c_lines = current.splitlines(keepends=True)
    sm = difflib.SequenceMatcher(None, p_lines, o_lines, autojunk=False)
    hunks = []
    for group in sm.get_grouped_opcodes(CONTEXT_LINES):
        i1, i2 = group[0][1], group[-1][2]
        j1, j2 = group[0][3], group[-1][4]
        at = _find_once(c_lines, p_lines[i1:i2])
        if at is None:
            return None
        hunks.append((at, at + (i2 - i1), o_lines[j1:j2]))
    hunks.sort()
    if any(a[1] > b[0] for a, b in zip(hunks, hunks[1:])):
        return None  # two hunks claim the same lines: no safe placement
    for start, end, new in reversed(hunks):
        c_lines[start:end] = new
    return b"".join(c_lines)
