"""Exit codes that mean one thing (issue 10, items 10-11): the README table and every
command's --help come from kvpatch.output.exitcodes; a crash is exit 2, never 1; a partial
apply is exit 5."""

from __future__ import annotations

import re
import shutil

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, FI_MLA, REPO
from kvpatch import engine
from kvpatch.cli.commands import main
from kvpatch.output.exitcodes import EXIT_ERROR, EXIT_PARTIAL, WHAT, markdown_table


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_readme_exit_table_is_the_one_in_exitcodes():
    readme = (REPO / "README.md").read_text()
    assert markdown_table() in readme


@pytest.mark.parametrize("command", sorted(WHAT))
def test_every_command_help_lists_its_exit_codes(command):
    r = run(command, "--help")
    assert r.exit_code == 0
    block = r.output.split("Exit codes:")[1].split("Options:")[0]
    listed = {int(c) for c in re.findall(r"^\s+(\d+)\s+\S", block, re.M)}
    assert listed == set(WHAT[command]), r.output


@pytest.mark.parametrize("verbose", [False, True])
def test_an_unexpected_error_exits_2_with_one_line(tmp_path, monkeypatch, verbose):
    def boom(*a, **k):
        raise RuntimeError("synthetic failure")

    # kvpatch.status first: importing it while engine.scan_tree is boom would bind boom for good.
    monkeypatch.setattr("kvpatch.status.scan_tree", boom)
    monkeypatch.setattr(engine, "scan_tree", boom)
    for cmd in (["audit"], ["status"]):
        r = run(*(["-v"] if verbose else []), *cmd, EXAMPLE)
        assert r.exit_code == EXIT_ERROR, (cmd, r.exit_code, r.output)
        assert "RuntimeError: synthetic failure" in r.output
        assert ("Traceback" in r.output) == verbose
        if not verbose:
            assert len(r.output.strip().splitlines()) == 1, r.output


def test_apply_writes_the_safe_files_and_exits_5_naming_the_skipped_one(tmp_path):
    tree = tmp_path / "sglang"
    shutil.copytree(EXAMPLE, tree)
    bad = "python/sglang/srt/layers/attention/broken_backend.py"
    (tree / bad).write_text("def f(pool, q):\n    return pool.get_key_buffer(0).to(q.dtype\n")
    r = run("apply", tree)
    assert r.exit_code == EXIT_PARTIAL, r.output
    assert bad in r.output
    assert "_kvpatch_rt.kv_for_mla_run(" in (tree / FI_MLA).read_text()


def test_apply_with_nothing_to_write_and_an_unreadable_file_is_2(tmp_path):
    tree = tmp_path / "t"
    tree.mkdir()
    (tree / "broken_backend.py").write_text("def f(pool, q):\n    return pool.get_key_buffer(0).to(q.dtype\n")
    r = run("apply", tree)
    assert r.exit_code == EXIT_ERROR, r.output
