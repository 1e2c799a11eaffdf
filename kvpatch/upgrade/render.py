"""The upgrade audit as text and SARIF."""

from __future__ import annotations

import ast
import textwrap
from typing import List, Tuple
from kvpatch.upgrade.model import patch_summary, CHANGED, FIXED, MOVED, NEW, PLAN_CATEGORIES, REMOVED, REPLACED, SITE_CATEGORIES, UNCHANGED, UNMATCHED, Upgrade
from kvpatch.upgrade.pairing import _one

# -- rendering -------------------------------------------------------------------------
_COLORS = {UNMATCHED: "red", NEW: "yellow", CHANGED: "yellow", FIXED: "green", REPLACED: "blue",
           REMOVED: "blue", MOVED: None, UNCHANGED: None}


def _short(text: str, width: int = 120) -> str:
    """The first sentence of a reason, at most `width` characters."""
    t = _one(text)
    cut = t.find(": ", 40)
    if 0 < cut < width and cut < len(t) - 2 and width <= 120:
        t = t[:cut] + " ..."
    return t if len(t) <= width else t[: width - 3] + "..."


def _one_line(stmt: str) -> str:
    """A statement on one line, without its comments (ast.unparse when it parses)."""
    for candidate in (stmt, textwrap.dedent(stmt)):
        try:
            return " ".join(ln.strip() for ln in ast.unparse(ast.parse(candidate)).splitlines())
        except (SyntaxError, ValueError):
            continue
    lines = [ln for ln in stmt.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    return " ".join(ln.strip() for ln in lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _first(stmt: str, width: int = 150) -> List[str]:
    return [_clip(_one_line(stmt), width)]


_OPEN, _CLOSE = "([{", ")]}"


def _arg_start(text: str, i: int) -> int:
    """Where the argument holding text[i] starts: after the ', ' or bracket before it."""
    depth = 0
    for j in range(i - 1, -1, -1):
        c = text[j]
        if c in _CLOSE:
            depth += 1
        elif c in _OPEN:
            if depth == 0:
                return j + 1
            depth -= 1
        elif c == "," and depth == 0:
            return j + 2 if text[j + 1:j + 2] == " " else j + 1
    return 0


def _arg_end(text: str, i: int) -> int:
    """Where the argument holding text[i - 1] ends: at the ',' or bracket after it."""
    depth = 0
    for j in range(i, len(text)):
        c = text[j]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            if depth == 0:
                return j
            depth -= 1
        elif c == "," and depth == 0:
            return j
    return len(text)


def changed_pair(old_stmt: str, new_stmt: str, width: int = 150) -> Tuple[str, str]:
    """The old and new statement on one line each. Where either is too long, both are cut
    to the arguments that differ (whole arguments, '...' for what is left out), so a
    change past the first `width` characters still shows."""
    a, b = _one_line(old_stmt), _one_line(new_stmt)
    if len(a) <= width and len(b) <= width:
        return a, b
    pre = 0
    while pre < min(len(a), len(b)) and a[pre] == b[pre]:
        pre += 1
    suf = 0
    while suf < min(len(a), len(b)) - pre and a[-1 - suf] == b[-1 - suf]:
        suf += 1
    start = min(_arg_start(a, pre), _arg_start(b, pre))

    call = a.find("(") + 1  # the callee stays in view: `wrapper.plan(... changed ...)`
    head = a[:call] if 0 < call <= start and a[:call] == b[:call] else ""

    def window(t: str) -> str:
        end = _arg_end(t, max(len(t) - suf, start))
        left = head + ("..., " if start > len(head) else "")
        right = ", ...)" if end < len(t) - 1 else t[end:]
        return left + _clip(t[start:end], width) + right
    return window(a), window(b)


def render(up: Upgrade, style, verbose: int = 0) -> str:
    out: List[str] = [style(f"kvpatch upgrade audit: {up.old.display} -> {up.new.display}", bold=True)]
    for title, entries, cats in (("sites", up.sites, SITE_CATEGORIES), ("plan calls", up.plans, PLAN_CATEGORIES)):
        counts = up.counts(entries, cats)
        out.append("")
        out.append(style(title, bold=True) + ": " + (", ".join(f"{n} {k}" for k, n in counts.items() if n) or "none"))
        shown_fn = set()
        for e in entries:
            if e.category == UNCHANGED and not verbose:
                continue
            flag = style("  ACTION", fg="red", bold=True) if e.action else ""
            r = e.rec
            status = (f"{e.old.status} -> {e.new.status}" if e.old is not None and e.new is not None
                      and e.old.status != e.new.status else r.status)
            fix = ", apply rewrites it" if e.new is not None and e.new.fixable else ""
            out.append(f"  {style(f'{e.category:<14}', fg=_COLORS.get(e.category))} {e.where()}  {r.qualname} "
                       f"[{status}{', ' + r.rule if r.rule else ''}{fix}]{flag}")
            out.append(f"  {'':14} {_one(e.why) if verbose else _short(e.why, 240)}")
            if e.category == CHANGED and e.old is not None and e.new is not None:
                minus, plus = changed_pair(e.old.statement, e.new.statement)
                out.append(f"  {'':14} - {minus}")
                out.append(f"  {'':14} + {plus}")
            elif e.category in (NEW, MOVED) and verbose and e.new is not None:
                out.append(f"  {'':14}   {_first(e.new.statement)[0]}")
            if e.function is not None and (e.function.file, e.function.qualname) not in shown_fn:
                shown_fn.add((e.function.file, e.function.qualname))
                f = e.function
                out.append(f"  {'':14} {f.file}:{f.line}-{f.end_line} `{f.qualname}`"
                           f"{' (excerpt)' if f.truncated else ''}:")
                for ln in f.source.rstrip("\n").splitlines():
                    out.append(f"  {'':14} | {ln}")
        if not verbose and counts.get(UNCHANGED):
            out.append(f"  {'unchanged':<14} {counts[UNCHANGED]} (-v lists them)")
    p = up.patch
    out.append("")
    out.append(style("apply on the new tree", bold=True) + ": " + (
        style("applies", fg="green") if not p.refused else style(f"refused for {len(p.refused)} file(s)", fg="red")))
    ps = patch_summary(p)
    if not p.rewrites and not p.runtimes:
        out.append("  nothing to rewrite")
    else:
        out.append(f"  {len(p.rewrites)} file(s) rewritten: {p.sites_rewritten} site(s), {p.plans_rewritten} plan "
                   f"call(s); {len(p.runtimes)} runtime file(s)")
        for f in ps["files"]:
            out.append(f"    {f['file']}: +{f['lines_added']} -{f['lines_removed']} lines, "
                       f"{len(f['sites'])} site(s), {len(f['plan_calls'])} plan call(s)")
        for rt in ps["runtime_files"]:
            out.append(f"    {rt['file']}: runtime ({rt['action']})")
    for r in p.refused:
        out.append(f"  refused {r.file}: {r.message}")
    for s in ps["skipped"]:
        out.append(f"  left as is: {s['file']}:{s['line']} [{s['status']}] {_short(s['reason'])}")
    if up.errors:
        out.append("")
        out.append(style("errors", bold=True, fg="red"))
        for t, e in up.errors:
            out.append(f"  ({t}) {e.file}{':' + str(e.line) if e.line else ''}: {e.message}")
    act = up.action_needed
    out.append("")
    if act:
        out.append(style(f"action needed ({len(act)})", bold=True, fg="red"))
        out += [f"  - {a}" for a in act]
    else:
        out.append(style("nothing new needs action", fg="green"))
    return "\n".join(out)


def summary_line(up: Upgrade) -> str:
    s = ", ".join(f"{n} {k}" for k, n in up.counts(up.sites, SITE_CATEGORIES).items() if n) or "none"
    p = ", ".join(f"{n} {k}" for k, n in up.counts(up.plans, PLAN_CATEGORIES).items() if n) or "none"
    patch = "applies" if not up.patch.refused else f"refused for {len(up.patch.refused)} file(s)"
    return (f"kvpatch audit (upgrade): sites: {s}; plan calls: {p}; apply {patch}; "
            f"{len(up.action_needed)} action(s) needed{f', {len(up.errors)} error(s)' if up.errors else ''}; "
            f"{up.seconds:.2f}s")


_SARIF_RULES = [
    ("KVU001", "new-site", "A KV-cache cast or MLA plan call that the old tree did not have"),
    ("KVU002", "changed-site", "A site whose statement, rule or buffer changed since the old tree"),
    ("KVU003", "unmatched-function", "A function that held a site, still casts, and no rule finds a site in it"),
    ("KVU004", "patch-refused", "kvpatch apply would refuse to rewrite this file"),
]
_SARIF_ID = {NEW: "KVU001", CHANGED: "KVU002", UNMATCHED: "KVU003"}


def to_sarif(up: Upgrade) -> str:
    ids = [r[0] for r in _SARIF_RULES]
    results = []
    for e in up.sites + up.plans:
        rid = _SARIF_ID.get(e.category)
        if rid is None:
            continue
        r = e.rec
        if e.new is not None:
            region = {"startLine": e.new.line}
            if e.is_site:
                region.update(startColumn=e.new.column + 1, endLine=e.new.end_line)
        elif e.function is not None:
            region = {"startLine": e.function.line, "endLine": e.function.end_line}
        else:
            region = {"startLine": max(1, r.line)}
        what = "site" if e.is_site else "plan call"
        results.append({
            "ruleId": rid, "ruleIndex": ids.index(rid), "level": "error" if e.action else "note",
            "message": {"text": f"[{e.category} {what}] {r.qualname}: {e.why}"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": r.file, "uriBaseId": "SRCROOT"},
                                                "region": region}}],
            "partialFingerprints": {"kvpatchSite/v1": e.key},
            "properties": {"category": e.category, "action": e.action, "qualname": r.qualname, "rule": r.rule,
                           "old_status": e.old.status if e.old is not None else None,
                           "new_status": e.new.status if e.new is not None else None},
        })
    for f in up.patch.refused:
        results.append({
            "ruleId": "KVU004", "ruleIndex": ids.index("KVU004"), "level": "error",
            "message": {"text": f"apply would refuse {f.file}: {f.message}"},
            "locations": [{"physicalLocation": {"artifactLocation": {"uri": f.file, "uriBaseId": "SRCROOT"}}}],
        })
    notes = [{"level": "error", "message": {"text": f"({t}) {e.file}{':' + str(e.line) if e.line else ''}: "
                                                   f"{e.message}"}} for t, e in up.errors]
    rules = [{"id": i, "name": n, "shortDescription": {"text": d},
              "defaultConfiguration": {"level": "error" if i in ("KVU003", "KVU004") else "warning"}}
             for i, n, d in _SARIF_RULES]
    from kvpatch.output.report import sarif_document

    return sarif_document(rules, results, notes, up.new.root,
                                 {"old": up.old.display, "new": up.new.display, "exit_code": up.exit_code})


