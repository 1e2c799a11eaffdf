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
