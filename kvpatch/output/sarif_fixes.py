"""sarif_fixes: SARIF 2.1.0 ``fixes`` for the sites ``kvpatch apply`` rewrites,
as ast-grep emits them.

apply rewrites a file as one unit (the cast, the plan calls it pairs with, the
import, the dtype attribute), so the fix of each rewritable site in a file holds
every replacement of that file's rewrite, plus the runtime module as a new file
where apply would write it. Regions are character offsets into the original
file (``charOffset``/``charLength``), exact for any line ending.
"""

from __future__ import annotations

import difflib
from typing import Dict, List, Tuple

from kvpatch.analysis.units import split_lines

SRCROOT = "SRCROOT"


def _replacements(old: str, new: str) -> List[Dict]:
    a, b = split_lines(old), split_lines(new)
    offsets = [0]
    for ln in a:
        offsets.append(offsets[-1] + len(ln))
    out = []
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        out.append({"deletedRegion": {"charOffset": offsets[i1], "charLength": offsets[i2] - offsets[i1]},
                    "insertedContent": {"text": "".join(b[j1:j2])}})
    return out


def _change(rel: str, replacements: List[Dict]) -> Dict:
    return {"artifactLocation": {"uri": rel, "uriBaseId": SRCROOT}, "replacements": replacements}


def fixes_by_site(patch) -> Dict[Tuple[str, int], Dict]:
    """(file, line) of every site or plan call apply rewrites -> its SARIF fix."""
    runtime_by_dir = {rt.rel.rpartition("/")[0]: rt for rt in patch.runtimes}
    out: Dict[Tuple[str, int], Dict] = {}
    for rw in patch.rewrites:
        changes = [_change(rw.rel, _replacements(rw.old_text, rw.new_text))]
        rt = runtime_by_dir.get(rw.rel.rpartition("/")[0])
        if rt is not None:
            old = rt.old.decode("utf-8") if rt.old is not None else ""
            changes.append(_change(rt.rel, _replacements(old, rt.data.decode("utf-8"))))
        fix = {"description": {"text": f"kvpatch apply's rewrite of {rw.rel}"
                                       + (f" (and the runtime module {rt.rel})" if rt is not None else "")},
               "artifactChanges": changes}
        for rec in list(rw.sites) + list(rw.plans):
            out[(rw.rel, rec.line)] = fix
    return out
