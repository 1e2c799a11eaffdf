"""The terminal side of `kvpatch apply -i`: show each change's hunk, ask.

Answers, as `fixit fix -i` and `ast-grep -i` take them: y (apply it), n (leave
it; recorded as declined), a (this one and every one after it), q (stop: what
was accepted so far is written, the rest is neither asked nor recorded).
End of input (Ctrl-D) is q. One line per answer; anything else asks again.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List

from kvpatch.rewrite.choose import Change, Selection
from kvpatch.cli.out import Out
from kvpatch.output.exitcodes import EXIT_ERROR
from kvpatch.patch import colorize_diff
from kvpatch.sites import PlanCall

PROMPT = "Apply this change? [y]es / [n]o / [a]ll remaining / [q]uit "
ANSWERS = {"y": "y", "yes": "y", "n": "n", "no": "n", "a": "a", "all": "a", "q": "q", "quit": "q"}


def refusal(dry_run: bool) -> str:
    """Why -i cannot run here ('' when it can)."""
    if dry_run:
        return "--interactive and --dry-run exclude each other (--dry-run shows every change; -i asks about each)"
    if not sys.stdin.isatty():
        return "--interactive reads its answers from a terminal, and stdin is not one (run `kvpatch apply` without -i)"
    return ""


def _header(out: Out, i: int, n: int, c: Change) -> str:
    lines = [out.style(f"[{i}/{n}] {c.rel}", bold=True)]
    for r in c.records:
        what = "plan call" if isinstance(r, PlanCall) else "cast"
        lines.append(f"  line {r.line}: {r.qualname} {what} [{r.rule}]")
    if len(c.records) > 1 and c.plans and c.casts:
        lines.append("  (these go together: the casts' rewrite is right only with the plan calls')")
    if c.adds_import:
        lines.append("  (and the runtime import at the top of the file)")
    return "\n".join(lines)


def _answer(out: Out) -> str:
    while True:
        out.echo(out.style(PROMPT, fg="yellow", bold=True), nl=False)
        sys.stdout.flush()
        line = sys.stdin.readline()
        if not line:  # end of input
            out.echo("q")
            return "q"
        got = ANSWERS.get(line.strip().lower())
        if got:
            return got
        out.echo("please answer y, n, a or q")


def asker(out: Out, root: Path, dry_run: bool, allow_dirty: bool):
    """apply -i's Asker (kvpatch.rewrite.choose), once what apply would refuse anyway is
    refused (a one-line error, exit 2) before any question."""
    from kvpatch import patch as P

    why = refusal(dry_run)
    if not why:
        try:
            P.preflight(root.resolve(), allow_dirty)
        except (P.PatchError, ValueError) as exc:  # ValueError: an unreadable state record
            why = str(exc)
    if why:
        out.error(why)
        sys.exit(EXIT_ERROR)

    def ask(changes: List[Change]) -> Selection:
        sel = Selection()
        rest = False
        for i, c in enumerate(changes):
            if rest:
                sel.accepted.add(i)
                continue
            out.echo(_header(out, i + 1, len(changes), c))
            hunk = c.hunk()
            out.echo((colorize_diff(hunk) if out.color_out else hunk).rstrip("\n"))
            got = _answer(out)
            if got == "q":
                sel.quit = True
                break
            (sel.declined if got == "n" else sel.accepted).add(i)
            rest = got == "a"
        return sel

    return ask


def answered(built) -> str:
    """One line: what the answers were."""
    sel = built.answers
    line = f"changes accepted: {len(sel.accepted)} of {built.changes}; declined: {len(sel.declined)}"
    left = built.changes - len(sel.accepted) - len(sel.declined)
    return line + (f"; not asked (quit): {left}" if sel.quit and left else "")
