"""The upgrade audit as text and SARIF."""

from __future__ import annotations

import ast
import textwrap
from typing import List
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


def _first(stmt: str, width: int = 150) -> List[str]:
    """A statement on one line, without its comments (ast.unparse when it parses)."""
    text = ""
    for candidate in (stmt, textwrap.dedent(stmt)):
        try:
            text = " ".join(ln.strip() for ln in ast.unparse(ast.parse(candidate)).splitlines())
            break
        except (SyntaxError, ValueError):
            continue
    if not text:
        lines = [ln for ln in stmt.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        text = " ".join(ln.strip() for ln in lines)
    return [text if len(text) <= width else text[: width - 3] + "..."]


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
                out.append(f"  {'':14} - {_first(e.old.statement)[0]}")
                out.append(f"  {'':14} + {_first(e.new.statement)[0]}")
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
    from kvpatch.report import sarif_document

    return sarif_document(rules, results, notes, up.new.root,
                                 {"old": up.old.display, "new": up.new.display, "exit_code": up.exit_code})


