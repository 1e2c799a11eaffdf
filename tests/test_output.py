"""Output a person reads: each command's summary line, "nothing to do" once,
a progress line that does not stay on screen."""

from __future__ import annotations

import io
import shutil

from click.testing import CliRunner

from kvpatch.cli.commands import Out, main
from kvpatch.cli.out import CLEAR_LINE


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)), env={})


def test_second_apply_says_nothing_to_do_once(example_git):
    assert run("apply", example_git).exit_code == 0
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    assert r.output.count("nothing to do") == 1, r.output
    assert r.output.splitlines()[-1].startswith("kvpatch apply:")


def test_rules_ends_with_its_summary_line():
    r = run("rules")
    assert r.exit_code == 0
    from kvpatch.rule import load_rules

    assert r.output.splitlines()[-1].startswith(f"kvpatch rules: {len(load_rules())} rule(s), ")


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_scan_progress_is_cleared_at_the_end(monkeypatch):
    err = _Tty()
    monkeypatch.setattr("sys.stderr", err)
    cb = Out("never", False, 0).progress()
    cb(1, 10)
    cb(10, 10)
    text = err.getvalue()
    assert "scanning 1/10 files" in text and "\n" not in text
    assert text.endswith(CLEAR_LINE)


def test_json_kernel_holds_no_markdown(example):
    import json

    sites = json.loads(run("audit", "--json", example).stdout)["sites"]
    kernels = [s["kernel"] for s in sites]
    assert "decode_wrapper.run" in kernels and not any("`" in k for k in kernels), kernels


def test_long_reasons_wrap_to_the_width_with_an_indent(example):
    from kvpatch.output import report
    from kvpatch.engine import scan_tree

    scan = scan_tree(example)
    wide = report.render_table(scan, lambda t, **k: t)
    narrow = report.render_table(scan, lambda t, **k: t, 0, 80)
    assert max(map(len, wide.splitlines())) > 120  # the reasons, unwrapped
    reason_lines = [ln for ln in narrow.splitlines() if ln.startswith(" " * 24)]
    # Only a single word longer than the room left may pass the width.
    assert reason_lines and all(len(ln) <= 80 or len(ln.split()) == 1 for ln in reason_lines)
    # Same words in the same order: wrapped between words, never inside one.
    assert " ".join(wide.split()) == " ".join(narrow.split())


def test_audit_takes_v_where_it_takes_q(example):
    plain, verbose = run("audit", example), run("audit", "-v", example)
    assert verbose.exit_code == plain.exit_code == 1
    statement = "k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"
    assert statement in verbose.output and statement not in plain.output
    assert run("-v", "audit", example).output.splitlines()[:-1] == verbose.output.splitlines()[:-1]  # but the time


ESC = "\x1b["


def _head(args, lines: int, cwd):
    """`kvpatch ARGS | head -LINES`: read LINES lines, then close the pipe as head does."""
    import os
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "kvpatch", *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "100"})
    got = [p.stdout.readline().decode() for _ in range(lines)]
    p.stdout.close()
    err = p.stderr.read().decode()
    return p.wait(timeout=120), got, err


def test_color_always_into_head_leaves_the_terminal_clean(tmp_path, example):
    """`kvpatch --color always apply --dry-run | head`: every line head shows closes the
    colours it opens, and the cut pipe ends kvpatch quietly with 141, not a crash (2)."""
    from kvpatch.output.exitcodes import EXIT_BROKEN_PIPE

    attention = example / "python/sglang/srt/layers/attention"
    for i in range(6):  # six backend folders, six runtime diffs: more than a pipe buffer (64 KiB)
        shutil.copytree(attention, attention.parent / f"attention{i}")  # holds, so the writer meets the cut
    rc, lines, err = _head(["--color", "always", "apply", "--dry-run", "--runtime-diff", example], 40, tmp_path)
    assert rc == EXIT_BROKEN_PIPE, (rc, err)
    assert "crashed" not in err and "Traceback" not in err and "Broken pipe" not in err, err
    coloured = [ln for ln in lines if ESC in ln]
    assert len(coloured) >= 5, lines
    for ln in coloured:
        assert ln.rstrip("\n").endswith(ESC + "0m"), repr(ln)


def test_a_styled_block_closes_its_colour_on_every_line():
    out = Out(color="always", quiet=False, verbose=0)
    text = out.style("first line\nsecond line\n", fg="red")
    assert all(ln.endswith(ESC + "0m") for ln in text.split("\n") if ln), repr(text)
    assert text.endswith("\n")


def _site_counts(line: str) -> str:
    """'1 no-op, 3 patched, 1 unsupported' out of a summary line's 'sites: ...;'."""
    return line.split("sites: ", 1)[1].split(";", 1)[0]


def test_apply_summary_gives_the_counts_after_apply(example):
    before = run("audit", example).output.splitlines()[-1]
    assert "3 hot" in before, before
    r = run("apply", example)
    assert r.exit_code == 0, r.output
    last = r.output.splitlines()[-1]
    assert last.startswith("kvpatch apply: ") and "after apply: sites: " in last, last
    assert "3 hot" not in last and "0 hot left" in last and "3 plan call(s): 3 patched" in last, last
    after = run("audit", example).output.splitlines()[-1]  # what a re-audit finds
    assert _site_counts(last) == _site_counts(after) + ", 0 hot left", (last, after)


def test_apply_summary_after_a_declined_change_counts_it_hot(example):
    """apply -i: the declined change's site stays hot; the accepted ones are patched."""
    from kvpatch import patch as P
    from kvpatch.rewrite import choose
    from kvpatch.output.report import applied_counts, apply_summary_line

    def ask(changes):  # the FA3 site (a change of its own) declined, everything else accepted
        no = {i for i, c in enumerate(changes) if c.rel.endswith("/flashattention_backend.py")}
        assert len(no) == 1, [c.rel for c in changes]
        return choose.Selection(accepted=set(range(len(changes))) - no, declined=no)

    built = P.build(example, ask=ask)
    sites, plans = applied_counts(built)
    assert sites["hot"] == 1 and sites["patched"] == 2 and plans["patched"] == 3
    assert "2 patched, 1 unsupported, 1 hot left; 3 plan call(s): 3 patched" in apply_summary_line(built)


# -- -v and -vv ----------------------------------------------------------------------
FA3 = "python/sglang/srt/layers/attention/flashattention_backend.py"


def _debug(r):
    return [ln for ln in r.output.splitlines() if ln.startswith("debug: ")]


def test_v_and_vv_of_audit_say_different_specific_things(example):
    v, vv = run("audit", "-v", example), run("-vv", "audit", example)
    assert v.exit_code == vv.exit_code == 1
    assert not _debug(v)  # -v: the sites' statements, no diagnostics
    statement = "k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"
    assert statement in v.stdout and vv.stdout == v.stdout  # -vv adds to stderr only
    d = _debug(vv)
    assert d[0] == "debug: config: none (no pyproject.toml with [tool.kvpatch] walking up from PATH)"
    assert "debug: rule KVP101 (flashinfer-mla-pool-cast): built-in" in d
    assert f"debug: scan of {example.resolve()}: 5 file(s) scanned, 4 candidate(s)" in d
    assert f"debug:   {FA3}: 1 site(s), 0 plan call(s)" in d
    assert d[-1].startswith("debug: time: scan ") and d[-1].endswith("s")
    assert not _debug(run("-q", "-vv", "audit", example))  # -q silences them


def test_v_and_vv_of_apply_say_different_specific_things(example, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(example, other)
    plain, v, vv = run("apply", "--dry-run", example), run("-v", "apply", example), run("-vv", "apply", other)
    assert plain.exit_code == v.exit_code == vv.exit_code == 0, (v.output, vv.output)
    line = f"  rewritten {FA3}:23 FlashAttentionBackend.forward_decode [KVP106, decode, flashattention]: "
    assert line in v.output and not _debug(v)
    assert "  would be rewritten " not in plain.output  # -v only
    assert line in vv.output
    assert sum(ln.startswith("  rewritten ") for ln in v.output.splitlines()) == 6  # 3 casts, 3 plan calls
    times = [ln for ln in _debug(vv) if ln.startswith("debug: time: ")]
    assert len(times) == 1 and [p.split()[0] for p in times[0][len("debug: time: "):].split(", ")] == \
        ["scan", "plan+rewrite", "write"], times
    rv = run("-v", "revert", example)
    assert f"  restored {FA3}" in rv.output and not _debug(rv)
    rvv = run("-vv", "revert", other)
    assert [ln for ln in _debug(rvv) if ln.startswith("debug: time: revert ")]


def test_v_and_vv_of_rules_and_the_help_documents_both(tmp_path):
    from test_plugin import RULE

    (tmp_path / "scratch_rule.py").write_text(RULE)
    v = CliRunner().invoke(main, ["-v", "rules"], env={"KVPATCH_RULES_PATH": str(tmp_path)})
    assert "        from: built-in (kvpatch.rules)" in v.output and not _debug(v)
    assert f"        from: {tmp_path / 'scratch_rule.py'}" in v.output, v.output
    vv = CliRunner().invoke(main, ["-vv", "rules"], env={"KVPATCH_RULES_PATH": str(tmp_path)})
    assert f"debug: rule KVP901 (scratch-kernel-cast): {tmp_path / 'scratch_rule.py'}" in _debug(vv)
    text = " ".join(run("--help").output.split())
    assert "-v each item's detail: audit, each site's statement" in text
    assert "-vv -v, plus diagnostics on stderr, each line `debug: ...`" in text
