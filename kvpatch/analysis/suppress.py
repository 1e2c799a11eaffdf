"""suppress: inline ``# kvpatch: ignore[KVP101]`` comments, as ``# noqa``,
``# lint-ignore`` and ``# nosemgrep`` work.

A comment ``# kvpatch: ignore`` (every rule) or ``# kvpatch: ignore[ID, ...]``
(those rules, by ID or NAME) on a line of a site, or on a line of the simple
statement that holds it (the header only, for a compound statement), suppresses
the site: it is reported ``suppressed`` with the comment's line, never
rewritten, and needs no action. Only findings that would need action or be
rewritten are suppressed; a patched or no-op site stays what it is.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from typing import Dict, FrozenSet, List, Optional, Tuple

from kvpatch.rule import Decision
from kvpatch.sites import HOT, PLAN_REWRITE, PLAN_UNSUPPORTED, SUPPRESSED, UNSUPPORTED

MARKER = "kvpatch: ignore"
# "# kvpatch: ignore" or "# kvpatch: ignore[KVP101, KVP102]"
COMMENT = re.compile(r"#\s*kvpatch:\s*ignore(?:\[(?P<ids>[^\]]*)\])?", re.IGNORECASE)
SUPPRESSIBLE = (HOT, UNSUPPORTED, PLAN_REWRITE, PLAN_UNSUPPORTED)
EVERY_RULE: FrozenSet[str] = frozenset()


def comments(text: str) -> Dict[int, FrozenSet[str]]:
    """line -> rule IDs/names the comment on it names (EVERY_RULE for a bare one)."""
    found: Dict[int, FrozenSet[str]] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type != tokenize.COMMENT:
                continue
            m = COMMENT.search(tok.string)
            if m:
                ids = m.group("ids")
                found[tok.start[0]] = (frozenset(i.strip().upper() for i in ids.split(",") if i.strip())
                                       if ids is not None else EVERY_RULE)
    except (tokenize.TokenError, SyntaxError):  # the file parsed with ast; be safe anyway
        pass
    return found


def _statement_spans(tree: ast.AST) -> List[Tuple[int, int]]:
    """(first, last) line of every statement; a compound one's header only."""
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.stmt):
            last = max(node.lineno, body[0].lineno - 1)
        else:
            last = node.end_lineno or node.lineno
        spans.append((node.lineno, last))
    return spans


def _statement_of(line: int, spans: List[Tuple[int, int]]) -> Tuple[int, int]:
    holding = [s for s in spans if s[0] <= line <= s[1]]
    return min(holding, key=lambda s: s[1] - s[0]) if holding else (line, line)


def _matches(ids: FrozenSet[str], rule) -> bool:
    return ids == EVERY_RULE or (rule is not None and bool({rule.ID.upper(), rule.NAME.upper()} & ids))


def apply(fa, tree: ast.AST) -> None:
    """Mark the decided records of FileAnalysis `fa` that a comment suppresses."""
    if not COMMENT.search(fa.text):
        return
    found = comments(fa.text)
    if not found:
        return
    spans = _statement_spans(tree)
    for d in fa.decided:
        rec = d.record
        if rec.status not in SUPPRESSIBLE:
            continue
        first, last = _statement_of(rec.line, spans)
        lines = range(min(first, rec.line), max(last, getattr(rec, "end_line", rec.line)) + 1)
        hit: Optional[int] = next((n for n in lines if n in found and _matches(found[n], d.rule)), None)
        if hit is None:
            continue
        comment = COMMENT.search(fa.lines[hit - 1]).group(0) if hit - 1 < len(fa.lines) else MARKER
        reason = f"suppressed by `{comment}` on line {hit} (was {rec.status}: {rec.reason})"
        d.decision = Decision(SUPPRESSED, reason)
        rec.status, rec.reason, rec.fixable, rec.suppressed_line = SUPPRESSED, reason, False, hit
