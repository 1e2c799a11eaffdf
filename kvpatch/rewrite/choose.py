"""choose: the changes `kvpatch apply -i` asks about, one at a time.

A change is the set of a file's fixable sites and plan calls that must be
rewritten together: the findings of rules linked by ``PAIRS_WITH`` or
``NEEDS_ALL`` in one file (a FlashInfer MLA file's KVP101 casts and the
KVP102 plan calls that tell them their rows) are one change, every other
site is a change of its own. Each change is rewritten alone, and checked, to
show its hunk; a file where one cannot be is offered as one change. The
prompt itself lives in kvpatch/cli/ask.py; nothing here reads a terminal.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Set

from kvpatch.rewrite.codegen import IMPORT_LINE
from kvpatch.engine import Decided, FileAnalysis
from kvpatch.rule import partners
from kvpatch.rewrite.transform import FileRewrite, RewriteError, plan_rewrite
from kvpatch.sites import PlanCall


@dataclass
class Change:
    rel: str
    decided: List[Decided]
    alone: FileRewrite  # the file with this change only

    @property
    def records(self) -> List:
        return sorted((d.record for d in self.decided), key=lambda r: r.line)

    @property
    def casts(self) -> List:
        return [r for r in self.records if not isinstance(r, PlanCall)]

    @property
    def plans(self) -> List:
        return [r for r in self.records if isinstance(r, PlanCall)]

    @property
    def adds_import(self) -> bool:
        return IMPORT_LINE in self.alone.new_text and IMPORT_LINE not in self.alone.old_text

    def hunk(self) -> str:
        """The unified diff of this change alone, without the runtime import's hunk."""
        rel = self.rel
        lines = list(difflib.unified_diff(self.alone.old_text.splitlines(True), self.alone.new_text.splitlines(True),
                                          f"a/{rel}", f"b/{rel}"))
        head, hunks = lines[:2], []
        for ln in lines[2:]:
            if ln.startswith("@@"):
                hunks.append([])
            hunks[-1].append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
        kept, hidden = [], 0
        for h in hunks:
            if _only_import(h):  # hidden: the hunks after it would name new-side lines 1-2 too far
                hidden += sum(1 for ln in h[1:] if ln[:1] == "+")
            else:
                kept.append([_shift_new(h[0], hidden)] + h[1:])
        return "".join(head + [ln for h in kept for ln in h])


_HUNK_HEAD = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+)((?:,\d+)?) @@")


def _shift_new(header: str, by: int) -> str:
    """A hunk's @@ line with its new-side start `by` lines earlier: the numbers of
    the file as written, less the runtime import's hunk that is not shown."""
    if not by:
        return header
    return _HUNK_HEAD.sub(lambda m: f"@@ -{m[1]} +{max(int(m[2]) - by, 0)}{m[3]} @@", header, count=1)


def _only_import(hunk: List[str]) -> bool:
    changed = [ln[1:].strip() for ln in hunk[1:] if ln[:1] in "+-"]
    return all(ln.startswith("+") for ln in hunk[1:] if ln[:1] in "+-") and IMPORT_LINE in changed \
        and all(c in ("", IMPORT_LINE) for c in changed)


@dataclass
class Selection:
    """What the user answered, by index into the list of changes asked."""

    accepted: Set[int] = field(default_factory=set)
    declined: Set[int] = field(default_factory=set)
    quit: bool = False  # `q`: the changes after it were not asked


Asker = Callable[[List[Change]], Selection]


def _linked(a: Decided, b: Decided) -> bool:
    if a.rule is None or b.rule is None:
        return False
    links = lambda r: {*partners(r), getattr(r, "NEEDS_ALL", None)}  # noqa: E731
    return b.rule.ID in links(a.rule) or a.rule.ID in links(b.rule)


def _groups(fixable: Sequence[Decided]) -> List[List[Decided]]:
    """Connected parts of the 'rules linked' graph, in source order."""
    parent = list(range(len(fixable)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, a in enumerate(fixable):
        for j in range(i):
            if _linked(a, fixable[j]):
                parent[find(i)] = find(j)
    parts: dict = {}
    for i, d in enumerate(fixable):
        parts.setdefault(find(i), []).append(d)
    return sorted(parts.values(), key=lambda g: min(d.record.line for d in g))


def changes(fa: FileAnalysis, rules, whole: FileRewrite) -> List[Change]:
    """The file's changes; `whole` is its full rewrite (already checked)."""
    fixable = [d for d in fa.decided if d.decision is not None and d.decision.fixable]
    groups = _groups(fixable)
    if len(groups) <= 1:
        return [Change(fa.rel, fixable, whole)]
    out = []
    for g in groups:
        try:
            alone = plan_rewrite(fa, rules, keep=g)
        except RewriteError:  # these sites are not independent after all: ask them as one
            return [Change(fa.rel, fixable, whole)]
        out.append(Change(fa.rel, g, alone))
    return out


def accepted_rewrite(fa: FileAnalysis, rules, picked: Sequence[Change]) -> Optional[FileRewrite]:
    """The file with the accepted changes only (checked: the rest stays fixable)."""
    if len(picked) == 1:
        return picked[0].alone
    return plan_rewrite(fa, rules, keep=[d for c in picked for d in c.decided])
