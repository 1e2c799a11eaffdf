"""revert on a file edited since apply (issue 10 item 5's other half).

`status` calls a file with edits outside its patched regions "patched", so
`revert` must take the rewrite back there without --force and keep the edits;
an edit inside a region or next to it is drift, and revert refuses as before.
"""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import FI_MLA, git
from kvpatch.cli.commands import main
from kvpatch.rewrite.reverse import reverse_patch


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def _edit(text: str) -> str:
    """Edits a user makes far from any patched region: a header comment, a new
    helper at the end, and a changed default in the module docstring."""
    lines = text.splitlines(keepends=True)
    doc = next(i for i, ln in enumerate(lines) if ln.startswith('"""'))
    lines.insert(doc + 1, "Edited by a user after kvpatch apply.\n")
    return "# local change: pinned for our cluster\n" + "".join(lines) + "\n\ndef user_helper():\n    return 1\n"


@pytest.mark.parametrize("with_git", [False, True], ids=["plain", "git"])
def test_revert_keeps_edits_made_outside_the_patched_regions(example, with_git):
    if with_git:
        git(example, "init", "-q", "-b", "main")
        git(example, "add", "-A")
        git(example, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qm", "upstream")
    f = example / FI_MLA
    original = f.read_text()
    assert run("apply", example).exit_code == 0
    f.write_text(_edit(f.read_text()))
    if with_git:
        git(example, "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-qam", "user edit")
    st = run("status", example)
    assert st.exit_code == 0 and st.output.startswith("patched"), st.output
    rv = run("revert", example)
    assert rv.exit_code == 0, rv.output
    assert "your edits kept" in rv.output
    assert f.read_text() == _edit(original)  # the original, plus exactly the user's edits
    assert not (example / (FI_MLA + ".kvpatch-drifted")).exists()
    assert run("status", example).output.startswith("not patched")


def test_an_edit_next_to_a_patched_region_is_still_drift_and_nothing_is_written(example):
    f = example / FI_MLA
    assert run("apply", example).exit_code == 0
    lines = f.read_text().splitlines(keepends=True)
    at = next(i for i, ln in enumerate(lines) if "_kvpatch_rt.kv_for_mla_run(" in ln)
    lines.insert(at, "        # a user comment right above the patched statement\n")
    f.write_text("".join(lines))
    before = f.read_bytes()
    rv = run("revert", example)
    assert rv.exit_code == 2 and "--force" in rv.output, rv.output
    assert f.read_bytes() == before


def test_reverse_patch_places_each_hunk_once_or_not_at_all():
    original = b"a\nb\nc\nd\ne\nf\ng\nh\ni\nj\nk\n"
    patched = original.replace(b"f\n", b"F1\nF2\n")
    edited = b"header\n" + patched + b"tail\n"
    assert reverse_patch(edited, patched, original) == b"header\n" + original + b"tail\n"
    assert reverse_patch(patched, patched, original) == original
    # the hunk and its context twice: no unique place, so no partial result
    assert reverse_patch(patched + patched, patched, original) is None
    # the patched lines themselves edited: not found
    assert reverse_patch(patched.replace(b"F2", b"F3"), patched, original) is None
