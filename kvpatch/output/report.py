"""report: audit results as a table, JSON (stable schema) or SARIF 2.1.0,
and the exit codes CI can rely on."""

from __future__ import annotations

import json
import textwrap
from collections import Counter
from typing import Dict, List, Tuple

from kvpatch import RULESET_VERSION, __version__
from kvpatch.sites import (FIXED_UPSTREAM, GATHERED, HOT, NEEDS_ACTION, NOOP, PATCHED, PLAN_IGNORED, PLAN_PATCHED,
                           PLAN_REWRITE, PLAN_STATUSES, SITE_STATUSES, SUPPRESSED, UNSUPPORTED, ScanResult, Site)

from kvpatch.output.exitcodes import EXIT_ACTION, EXIT_ERROR, EXIT_OK

JSON_SCHEMA_ID = "kvpatch.audit/1"

# The JSON output's schema (JSON Schema draft 2020-12). Additive changes keep
# the id; anything else bumps it.
_SITE = {
    "type": "object",
    "required": ["file", "line", "end_line", "column", "qualname", "path", "backend", "buffer", "dtype",
                 "form", "kernel", "status", "reason", "rule", "fixable", "statement", "notes"],
    "properties": {
        "file": {"type": "string"}, "line": {"type": "integer"}, "end_line": {"type": "integer"},
        "column": {"type": "integer"}, "qualname": {"type": "string"},
        "path": {"enum": ["prefill", "decode", "other"]}, "backend": {"type": "string"},
        "buffer": {"type": "string"}, "dtype": {"type": "string"},
        "form": {"enum": ["assignment", "inline", "two-statement", "patched", "direct"]},
        "kernel": {"type": "string"}, "status": {"enum": list(SITE_STATUSES)},
        "reason": {"type": "string"}, "rule": {"type": ["string", "null"]}, "fixable": {"type": "boolean"},
        "statement": {"type": "string"}, "notes": {"type": "array", "items": {"type": "string"}},
    },
}
_PLAN = {
    "type": "object",
    "required": ["file", "line", "qualname", "receiver", "form", "q_dtype", "kv_dtype", "page_size", "causal",
                 "status", "reason", "rule", "fixable", "statement"],
    "properties": {
        "file": {"type": "string"}, "line": {"type": "integer"}, "qualname": {"type": "string"},
        "receiver": {"type": "string"}, "form": {"enum": ["positional", "keyword", "function"]},
        "q_dtype": {"type": ["string", "null"]}, "kv_dtype": {"type": ["string", "null"]},
        "page_size": {"type": ["string", "null"]}, "causal": {"type": ["string", "null"]},
        "status": {"enum": list(PLAN_STATUSES)},
        "reason": {"type": "string"}, "rule": {"type": ["string", "null"]}, "fixable": {"type": "boolean"},
        "statement": {"type": "string"},
    },
}
JSON_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": JSON_SCHEMA_ID,
    "type": "object",
    "required": ["schema", "kvpatch_version", "ruleset_version", "root", "files_scanned", "candidate_files",
                 "seconds", "summary", "sites", "plan_calls", "errors", "exit_code"],
    "properties": {
        "schema": {"const": JSON_SCHEMA_ID},
        "kvpatch_version": {"type": "string"}, "ruleset_version": {"type": "string"},
        "root": {"type": "string"}, "files_scanned": {"type": "integer"},
        "candidate_files": {"type": "integer"}, "seconds": {"type": "number"},
        "summary": {"type": "object", "additionalProperties": {"type": "integer"}},
        "sites": {"type": "array", "items": _SITE},
        "plan_calls": {"type": "array", "items": _PLAN},
        "errors": {"type": "array", "items": {"type": "object", "required": ["file", "message", "line"]}},
        "exit_code": {"enum": [0, 1, 2]},
    },
}


def audit_exit_code(scan: ScanResult) -> int:
    if scan.all_errors:
        return EXIT_ERROR
    if any(s.status in NEEDS_ACTION for s in scan.sites):
        return EXIT_ACTION
    return EXIT_OK


def summary_counts(scan: ScanResult) -> Dict[str, int]:
    c = Counter(s.status for s in scan.sites)
    return {k: c.get(k, 0) for k in SITE_STATUSES}


def summary_line(command: str, scan: ScanResult, extra: str = "") -> str:
    counts = summary_counts(scan)
    parts = ", ".join(f"{n} {k}" for k, n in counts.items() if n) or "no sites"
    errs = f", {len(scan.all_errors)} error(s)" if scan.all_errors else ""
    return (f"kvpatch {command}: {scan.files_scanned} files scanned ({scan.candidates} candidates); "
            f"sites: {parts}; {len(scan.plans)} plan call(s){errs}{extra}; {scan.seconds:.2f}s")


def applied_counts(patch) -> Tuple[Dict[str, int], Dict[str, int]]:
    """(site counts, plan call counts) as the checkout stands after `patch` is
    written: each site and plan call in a rewrite is patched; the rest, declined
    and unasked ones of apply -i included, keep the status the scan gave them."""
    # The rewrites hold the scan's own records (apply analyses each file once).
    done = {id(r) for rw in patch.rewrites for r in rw.sites + rw.plans}
    c = Counter(PATCHED if id(s) in done else s.status for s in patch.scan.sites)
    pc = Counter(PLAN_PATCHED if id(p) in done else p.status for p in patch.scan.plans)
    return {k: c.get(k, 0) for k in SITE_STATUSES}, {k: pc.get(k, 0) for k in PLAN_STATUSES}


def apply_summary_line(patch, extra: str = "") -> str:
    """`kvpatch apply`'s last line: the counts after apply (not the scan's before),
    always saying how many hot sites are left."""
    scan = patch.scan
    counts, plan_counts = applied_counts(patch)
    parts = ", ".join(f"{n} {k}" for k, n in counts.items() if n and k != HOT)
    plans = ", ".join(f"{n} {k}" for k, n in plan_counts.items() if n)
    errs = f", {len(scan.all_errors)} error(s)" if scan.all_errors else ""
    return (f"kvpatch apply: {scan.files_scanned} files scanned ({scan.candidates} candidates); "
            f"after apply: sites: {parts + ', ' if parts else ''}{counts[HOT]} hot left; "
            f"{len(scan.plans)} plan call(s){': ' + plans if plans else ''}{errs}{extra}; {scan.seconds:.2f}s")


def to_dict(scan: ScanResult) -> Dict:
    return {
        "schema": JSON_SCHEMA_ID,
        "kvpatch_version": __version__,
        "ruleset_version": RULESET_VERSION,
        "root": str(scan.root),
        "files_scanned": scan.files_scanned,
        "candidate_files": scan.candidates,
        "seconds": round(scan.seconds, 3),
        "summary": summary_counts(scan),
        # The table quotes code in backticks; JSON holds the plain names ("a.run, b.run").
        "sites": [{**s.to_dict(), "kernel": s.kernel.replace("`", "")} for s in scan.sites],
        "plan_calls": [p.to_dict() for p in scan.plans],
        "errors": [e.to_dict() for e in scan.all_errors],
        "exit_code": audit_exit_code(scan),
    }


def to_json(scan: ScanResult) -> str:
    return json.dumps(to_dict(scan), indent=2) + "\n"


_LEVEL = {HOT: "error", UNSUPPORTED: "warning"}


def _rule_ref(rid, rule_ids: List[str]) -> Dict:
    """ruleId, and ruleIndex only where the rule is in the run's rules array."""
    return {"ruleId": rid, **({"ruleIndex": rule_ids.index(rid)} if rid in rule_ids else {})}


def to_sarif(scan: ScanResult, rules, fixes=None) -> str:
    """`fixes`: (file, line) -> SARIF fix (kvpatch.output.sarif_fixes), for rewritable records."""
    rule_ids = [r.ID for r in rules]
    fallback = next((r.ID for r in rules if r.FALLBACK), rule_ids[0] if rule_ids else "")
    plan_fallback = next((r.ID for r in rules if r.KIND == "plan"), fallback)
    fixes = fixes or {}

    def fix(rec) -> Dict:
        got = fixes.get((rec.file, rec.line)) if rec.fixable else None
        return {"fixes": [got]} if got else {}

    results = []
    for s in scan.sites:
        results.append({
            **_rule_ref(s.rule or fallback, rule_ids),
            "level": _LEVEL.get(s.status, "note"),
            "message": {"text": f"[{s.status}] {s.qualname} ({s.path}): {s.reason}"},
            "locations": [{"physicalLocation": {
                "artifactLocation": {"uri": s.file, "uriBaseId": "SRCROOT"},
                "region": {"startLine": s.line, "startColumn": s.column + 1, "endLine": s.end_line},
            }}],
            "partialFingerprints": {"kvpatchSite/v1": s.key},
            "properties": {"status": s.status, "qualname": s.qualname, "path": s.path, "backend": s.backend,
                           "kernel": s.kernel, "fixable": s.fixable},
            **_suppressions(s), **fix(s),
        })
    for p in scan.plans:
        results.append({
            **_rule_ref(p.rule or plan_fallback, rule_ids),
            "level": "note",
            "message": {"text": f"[plan {p.status}] {p.qualname}: q dtype {p.q_dtype}, kv dtype {p.kv_dtype}, "
                                f"page size {p.page_size}: {p.reason}"},
            "locations": [{"physicalLocation": {
                "artifactLocation": {"uri": p.file, "uriBaseId": "SRCROOT"},
                "region": {"startLine": p.line},
            }}],
            "properties": {"status": p.status, "qualname": p.qualname},
            **_suppressions(p), **fix(p),
        })
    notifications = [{
        "level": "error",
        "message": {"text": f"{e.file}: {e.message}"},
        "locations": [{"physicalLocation": {"artifactLocation": {"uri": e.file, "uriBaseId": "SRCROOT"},
                                            **({"region": {"startLine": e.line}} if e.line else {})}}],
    } for e in scan.all_errors]
    sarif_rules = [{"id": r.ID, "name": r.NAME, "shortDescription": {"text": r.SUMMARY},
                    "fullDescription": {"text": (r.__class__.__doc__ or r.SUMMARY).strip()},
                    "defaultConfiguration": {"level": "error" if r.KIND == "cast" else "note"}} for r in rules]
    return sarif_document(sarif_rules, results, notifications, scan.root)


def _suppressions(rec) -> Dict:
    """SARIF's in-source suppression of a `# kvpatch: ignore` record (none otherwise)."""
    if rec.suppressed_line is None:
        return {}
    return {"suppressions": [{"kind": "inSource", "justification": rec.reason, "location": {"physicalLocation": {
        "artifactLocation": {"uri": rec.file, "uriBaseId": "SRCROOT"},
        "region": {"startLine": rec.suppressed_line}}}}]}


def sarif_document(rules: List[Dict], results: List[Dict], notifications: List[Dict], root, properties=None) -> str:
    """One SARIF 2.1.0 run of kvpatch (audit and upgrade audit share it)."""
    run = {
        "tool": {"driver": {
            "name": "kvpatch", "version": __version__, "semanticVersion": __version__,
            "rules": rules,
        }},
        "originalUriBaseIds": {"SRCROOT": {"uri": root.as_uri() + "/"}},
        "invocations": [{"executionSuccessful": not notifications,
                         "toolExecutionNotifications": notifications}],
        "results": results,
    }
    if properties:
        run["properties"] = properties
    doc = {"$schema": "https://json.schemastore.org/sarif-2.1.0.json", "version": "2.1.0", "runs": [run]}
    return json.dumps(doc, indent=2) + "\n"


def render_table(scan: ScanResult, style, verbose: int = 0, width: int = 0) -> str:
    """Human output: sites grouped by file, then plan calls, then errors.
    `width` > 0 wraps reasons and notes to it, indented, never inside a word."""
    out: List[str] = []
    pad = " " * 24

    def text(t: str) -> str:
        if width <= len(pad) + 20:
            return pad + t
        return textwrap.fill(t, width, initial_indent=pad, subsequent_indent=pad + "  ",
                             break_long_words=False, break_on_hyphens=False)

    colors = {HOT: "red", UNSUPPORTED: "yellow", PATCHED: "green", NOOP: "blue",
              GATHERED: "blue", FIXED_UPSTREAM: "green", PLAN_REWRITE: "yellow", PLAN_IGNORED: "blue",
              SUPPRESSED: "magenta"}
    by_file: Dict[str, List] = {}
    for s in scan.sites:
        by_file.setdefault(s.file, []).append(s)
    for p in scan.plans:
        by_file.setdefault(p.file, []).append(p)
    for f in sorted(by_file):
        out.append(style(f, bold=True))
        for r in sorted(by_file[f], key=lambda r: r.line):
            st = style(f"{r.status:<14}", fg=colors.get(r.status))
            if isinstance(r, Site):
                fix = " (apply rewrites it)" if r.fixable else ""
                out.append(f"  {r.line:>5}  {st} {r.qualname} [{r.path}, {r.backend}] -> {r.kernel}{fix}")
                out.append(text(r.reason))
                for n in r.notes:
                    out.append(text(f"note: {n}"))
                if verbose:
                    out.append(f"         {'':14} {r.statement.splitlines()[0] if r.statement else ''}")
            else:
                out.append(f"  {r.line:>5}  {st} {r.qualname}: plan q={r.q_dtype} kv={r.kv_dtype} "
                           f"page_size={r.page_size} causal={r.causal}")
                out.append(text(r.reason))
    if scan.all_errors:
        out.append(style("errors", bold=True, fg="red"))
        for e in scan.all_errors:
            where = f":{e.line}" if e.line else ""
            out.append(f"  {e.file}{where}: {e.message}")
    return "\n".join(out)
