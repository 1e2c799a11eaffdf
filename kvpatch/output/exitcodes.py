"""exitcodes: every exit code kvpatch uses, each with one meaning per command.

The README's exit-code table is checked against WHAT (tests/test_exitcodes.py).
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ACTION = 1  # audit: hot sites remain; status: not/partly patched; upgrade: action needed; verify: a case failed
EXIT_ERROR = 2  # an error or refusal, an unexpected crash included (one line; -v shows the traceback)
EXIT_DRIFT = 3  # status: a patched region was edited by hand
EXIT_UNVERIFIED = 3  # verify: what ran passed, but not all of it: no GPU, or a patched file no driver covers
EXIT_INTERRUPTED = 4  # status: an interrupted write is pending, or one is in progress
EXIT_PARTIAL = 5  # apply: the files that are safe were written; the others (named) were skipped
EXIT_USER_INTERRUPT = 130  # Ctrl-C or SIGTERM: everything was rolled back
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for `git log | head`: the reader left early

# command -> {code: meaning}: what each command's --help and the README say.
WHAT = {
    "audit": {EXIT_OK: "no unpatched hot site (upgrade audit: nothing needs action)",
              EXIT_ACTION: "hot or unsupported sites remain (upgrade audit: action needed)",
              EXIT_ERROR: "error: bad path, unreadable or unparseable file (named; the other files are still "
                          "scanned)"},
    "apply": {EXIT_OK: "applied, or nothing to do",
              EXIT_ERROR: "error or refusal: nothing written",
              EXIT_PARTIAL: "applied to the files that are safe; the unparseable or refused ones (named) were "
                            "skipped (a file it cannot read refuses the whole apply: exit 2)",
              EXIT_USER_INTERRUPT: "interrupted: everything rolled back"},
    "revert": {EXIT_OK: "restored", EXIT_ERROR: "error or refusal (no record, drift without --force): "
                                                "nothing changed",
               EXIT_USER_INTERRUPT: "interrupted: everything rolled back"},
    "recover": {EXIT_OK: "rolled back, or nothing to do", EXIT_ERROR: "refused (an unsafe journal, a target it "
                                                                      "cannot write): nothing touched",
                EXIT_USER_INTERRUPT: "interrupted: run it again"},
    "status": {EXIT_OK: "patched (or nothing to patch)", EXIT_ACTION: "not patched, or partly patched",
               EXIT_ERROR: "error", EXIT_DRIFT: "drifted: a patched region was edited by hand",
               EXIT_INTERRUPTED: "an interrupted write is pending (or one is in progress)"},
    "verify": {EXIT_OK: "passed on the GPU (or `--cpu` passed)", EXIT_ACTION: "a case failed",
               EXIT_ERROR: "error", EXIT_UNVERIFIED: "partly verified: no GPU (only the CPU check ran), or a patched file verify cannot drive (named)"},
    "rules": {EXIT_OK: "listed", EXIT_ERROR: "error"},
    "test": {EXIT_OK: "every example holds", EXIT_ACTION: "an example failed", EXIT_ERROR: "error"},
    "config": {EXIT_OK: "shown", EXIT_ERROR: "a bad config (file and key named)"},
}
for _read_only in ("audit", "status", "verify", "rules", "test", "config"):
    WHAT[_read_only][EXIT_USER_INTERRUPT] = "interrupted (nothing is written)"
for _cmd in WHAT:  # nothing prints while files are being written: a write is done or not begun
    WHAT[_cmd][EXIT_BROKEN_PIPE] = "output cut short: its reader (`head`, say) closed the pipe"


def markdown_table() -> str:
    """The README's exit-code table: one row per code, one column per command."""
    cmds = list(WHAT)
    codes = sorted({c for m in WHAT.values() for c in m})
    rows = ["| code | " + " | ".join(cmds) + " |", "|---|" + "---|" * len(cmds)]
    for code in codes:
        rows.append(f"| {code} | " + " | ".join(WHAT[c].get(code, "-") for c in cmds) + " |")
    return "\n".join(rows) + "\n"
