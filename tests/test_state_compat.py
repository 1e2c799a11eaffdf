"""state.json written by an earlier kvpatch still reads (issue 9 dropped the
always-null, never-read `branch` field from kvpatch.state/1)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from conftest import tree_hashes
from kvpatch.cli.commands import main


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_a_state_with_the_old_branch_field_still_reads(example):
    original = tree_hashes(example)
    assert run("apply", example).exit_code == 0
    path = example / ".kvpatch/state.json"
    state = json.loads(path.read_text())
    assert "branch" not in state  # not written any more
    state["branch"] = None  # as kvpatch wrote it before
    path.write_text(json.dumps(state, indent=2) + "\n")
    st = run("status", "--json", example)
    assert st.exit_code == 0 and json.loads(st.stdout)["state"] == "patched", st.output
    rv = run("revert", example)
    assert rv.exit_code == 0, rv.output
    assert tree_hashes(example) == original


def test_a_site_record_without_also_or_with_a_later_key_still_reads(example):
    """`also` (the routed calls a site's rewrite changed) is written only where there are
    some; a record without it (an earlier kvpatch) reads, and so does a key this kvpatch does
    not know (a later one): status still checks what it knows."""
    assert run("apply", example).exit_code == 0
    path = example / ".kvpatch/state.json"
    state = json.loads(path.read_text())
    sites = [s for f in state["files"] for s in f["sites"]]
    assert any("also" in s for s in sites) and any("also" not in s for s in sites)
    for s in sites:
        s.pop("also", None)
        s["from_a_later_kvpatch"] = 1
    path.write_text(json.dumps(state, indent=2) + "\n")
    st = run("status", "--json", example)
    assert st.exit_code == 0 and json.loads(st.stdout)["state"] == "patched", st.output
