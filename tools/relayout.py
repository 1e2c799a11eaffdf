"""Rewrite kvpatch import paths from the flat layout to the stage folders (issue 19).

    python tools/relayout.py FILE...        # rewrites in place, prints what it changed

For code written against the flat kvpatch/ (a branch forked before the move, a rule of
your own): `from kvpatch import checkout, write`, `from kvpatch.codegen import ...`,
`"kvpatch.write.os.replace"`, `kvpatch/guarded.py` become their new paths. Running it
twice changes nothing. It is text substitution: read the diff.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

# old top-level module -> new dotted path under kvpatch
MOVES = {
    **{m: f"analysis.{m}" for m in ("discover", "locate", "units", "match", "dataflow", "classify",
                                     "stable", "tensorops", "pagedcall", "candidates", "suppress")},
    "rewrite": "rewrite.transform", "codegen": "rewrite.codegen", "initattr": "rewrite.initattr",
    "choose": "rewrite.choose", "reverse": "rewrite.reverse",
    "checkout": "checkout.repo",
    **{m: f"checkout.{m}" for m in ("git", "gittxn", "write", "state", "originals", "lock", "safepath",
                                     "guarded")},
    "report": "output.report", "sarif_fixes": "output.sarif_fixes", "exitcodes": "output.exitcodes",
    "cli": "cli.commands", "cli_ask": "cli.ask", "cli_info": "cli.info", "cli_out": "cli.out",
    "cli_test": "cli.testing",
}
# old modules whose name is now a package: kvpatch.<name> alone is ambiguous
NOW_PACKAGES = {"rewrite", "checkout", "cli"}
SUBMODULES = {pkg: {new.split(".")[1] for new in MOVES.values() if new.startswith(pkg + ".")}
              for pkg in NOW_PACKAGES}


def _from_kvpatch(m: re.Match, renamed: list) -> str:
    """`from kvpatch import a, b as c`: one line per moved module."""
    indent, names = m.group(1), m.group(2)
    if names.strip().startswith("("):
        return m.group(0)
    keep, lines = [], []
    for item in (x.strip() for x in names.split(",")):
        name, _, alias = (s.strip() for s in item.partition(" as "))
        if name not in MOVES:
            keep.append(item)
            continue
        pkg, _, mod = MOVES[name].rpartition(".")
        local = alias or name
        if name == "checkout" and not alias:
            local = mod  # `checkout.git_info(...)` becomes `repo.git_info(...)` below
            renamed.append(("checkout", "repo"))
        lines.append(f"{indent}from kvpatch.{pkg} import {mod}" + (f" as {local}" if local != mod else ""))
    out = ([f"{indent}from kvpatch import {', '.join(keep)}"] if keep else []) + lines
    return "\n".join(out)


def _from_module(m: re.Match) -> str:
    """`from kvpatch.X import names` where X is an old module (not a new package's submodule)."""
    indent, name, names = m.group(1), m.group(2), m.group(3)
    if name in NOW_PACKAGES:
        first = names.strip().lstrip("(").split(",")[0].split(" as ")[0].strip()
        if first in SUBMODULES[name]:
            return m.group(0)  # already the new layout: from kvpatch.checkout import repo
    return f"{indent}from kvpatch.{MOVES[name]} import {names}"


def _dotted(m: re.Match) -> str:
    name, rest = m.group(1), m.group(2) or ""
    if name in NOW_PACKAGES:
        nxt = rest[1:].split(".")[0] if rest.startswith(".") else ""
        if not nxt or nxt in SUBMODULES[name]:
            return m.group(0)  # `kvpatch.cli` alone, or already kvpatch.cli.commands
    return f"kvpatch.{MOVES[name]}{rest}"


def relayout(text: str) -> str:
    renamed: list = []
    text = re.sub(r"^([ \t]*)from kvpatch import ([^\n]+)$", lambda m: _from_kvpatch(m, renamed), text, flags=re.M)
    text = re.sub(r"^([ \t]*)from kvpatch\.(" + "|".join(MOVES) + r") import ([^\n]+)$", _from_module, text,
                  flags=re.M)
    # `import kvpatch.x`, "kvpatch.x.attr" strings (monkeypatch targets), prose; not kvpatch/x
    lines = []
    for line in text.split("\n"):
        if not re.match(r"^\s*from kvpatch\.\S+ import ", line):
            line = re.sub(r"(?<![\w/.])kvpatch\.(" + "|".join(MOVES) + r")\b((?:\.\w+)*)(?![/\w])", _dotted, line)
        lines.append(line)
    text = "\n".join(lines)
    text = re.sub(r"(?<![\w.])kvpatch/(" + "|".join(MOVES) + r")\.py\b",
                  lambda m: "kvpatch/" + MOVES[m.group(1)].replace(".", "/") + ".py", text)
    # a module imported as `checkout` is now `repo`: rename its uses (not "checkout.py" in prose)
    for a, b in set(renamed):
        text = "\n".join(line if line.lstrip().startswith("#") else
                         re.sub(rf"(?<![\w./-]){a}\.(?!py\b)(?=[A-Za-z_])", f"{b}.", line)
                         for line in text.split("\n"))
    return text


def main(argv) -> int:
    for name in argv:
        path = Path(name)
        old = path.read_text(encoding="utf-8")
        new = relayout(old)
        if new != old:
            path.write_text(new, encoding="utf-8")
            print(f"rewrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
