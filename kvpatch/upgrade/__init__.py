"""upgrade: what changed for kvpatch between two versions of a checkout.

``kvpatch audit PATH --against REF`` compares git REF of PATH's repository
(old) with PATH's working tree (new); ``kvpatch audit OLD_DIR NEW_DIR``
compares two trees. Both trees are audited, every site and plan call is
paired across them by its line-independent identity (file, qualname, rule,
buffer), and each gets one category. Then ``patch.build`` runs on the new
tree: which files apply would rewrite, which it refuses, and why.

Site categories
    unchanged       same identity, same statement (ignoring formatting and
                    comments), same line
    moved           same identity and statement, another line; or the same
                    statement in a moved file or a renamed function
    changed         same identity, another statement (both are shown); also
                    when only the rule or the buffer expression changed
                    (e.g. ``forward_batch.token_to_kv_pool`` -> ``self.token_to_kv_pool``)
    new             only in the new tree
    removed         only in the old tree, and its function is gone (when a
                    same-named function of the new tree is at least 60% alike,
                    the function "moved" there and the categories below apply)
    fixed-upstream  a site that needed action (hot, unsupported, patched) whose
                    function is still there, but whose cast is gone or is no
                    longer pool-wide: its status in new is gathered,
                    fixed-upstream or no-op, or no cast is left in the function
    replaced        only in the old tree; the function is still there and holds
                    other sites now (listed in ``replaced_by``)
    unmatched       only in the old tree; the function is still there and still
                    casts something (or reads a KV buffer and casts), but no
                    rule finds a site: a person must look (its source is shown)

Plan-call categories: unchanged, moved, changed, new, removed (the call is
gone; ``why`` says whether its function is), replaced, unmatched (the
function still calls ``.plan(`` but no call is recognised).

Action needed (exit 1): a new hot or unsupported site; a site that became hot
or unsupported, or that apply rewrote (or had patched) in old and cannot
rewrite in new; an unmatched site or plan call; a plan call that is new, or
became, unsupported; or a file whose rewrite apply would refuse. A site that
changed shape but is still rewritten, or that was already hot and unfixable
before, is reported and does not fail the gate. Exit 2: an error (bad path or
ref, a file that does not parse or decode in either tree).

JSON (``--json``), schema id ``kvpatch.upgrade/1`` (``JSON_SCHEMA`` below is the
machine-readable form; additive changes keep the id)::

    {
      "schema": "kvpatch.upgrade/1",
      "kvpatch_version": str, "ruleset_version": str,
      "old": TREE, "new": TREE,
      "summary": {"sites": {CATEGORY: int}, "plan_calls": {CATEGORY: int}},
      "sites": [ENTRY], "plan_calls": [ENTRY],
      "patch": {
        "applies": bool,              # no file refused
        "files": [{"file": str, "sites": [key], "plan_calls": [key],
                   "lines_added": int, "lines_removed": int}],
        "runtime_files": [{"file": str, "action": "create" | "update"}],
        "refused": [{"file": str, "message": str}],
        "skipped": [{"key": str, "file": str, "line": int, "status": str, "reason": str}],
        "sites_rewritten": int, "plans_rewritten": int
      },
      "errors": [{"tree": "old" | "new", "file": str, "message": str, "line": int | null}],
      "action_needed": [str],         # one line per reason for exit 1
      "exit_code": 0 | 1 | 2,
      "seconds": float
    }
    TREE  = {"root": str, "ref": str | null, "commit": str | null,
             "files_scanned": int,          # .py files (at REF: all of them, from git)
             "candidate_files": int, "seconds": float,
             "summary": {STATUS: int}}      # site statuses, as in kvpatch.audit/1
    ENTRY = {"category": CATEGORY, "action": bool, "why": str,
             "key": str,                    # the new record's key, else the old one's
             "file": str, "qualname": str, "rule": str | null,
             "buffer": str | null,         # sites; plan calls: null
             "receiver": str | null,       # plan calls; sites: null
             "old": SITE | PLAN | null, "new": SITE | PLAN | null,   # as in kvpatch.audit/1
             "old_status": str | null, "new_status": str | null,
             "statement_changed": bool,
             "replaced_by": [key],
             "function": null | {"file": str, "qualname": str, "line": int, "end_line": int,
                                 "reads_kv_buffer": bool, "casts": [{"line": int, "code": str}],
                                 "source": str, "truncated": bool}}

SARIF (``--sarif``): one SARIF 2.1.0 result per new, changed or unmatched
entry and per refused file, located in the new tree (rules KVU001 new-site,
KVU002 changed-site, KVU003 unmatched-function, KVU004 patch-refused); level
error when the entry needs action, else note.

The package: model (records and schema, data only), inventory (a tree's
functions, their KV casts and plan calls), pairing (old vs new entries),
gitref (a git ref as a tree), flow (the run), render (text, SARIF),
command (the CLI body).
"""

from kvpatch.upgrade.command import cli_audit

__all__ = ["cli_audit"]  # kvpatch/cli/commands.py calls upgrade.cli_audit
