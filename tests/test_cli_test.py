"""`kvpatch test`: a rule author runs a local rule's own examples from the CLI."""

from __future__ import annotations

from click.testing import CliRunner

from kvpatch.cli.commands import main
from test_plugin import RULE as REWRITING_RULE

# test_plugin's scratch rule, report-only (its INVALID example expects no rewrite).
EDITS = ",\n                        [ReplaceNode(ctx.unit.qualname, cand.call, build), NeedRuntime()])"
assert EDITS in REWRITING_RULE
RULE = REWRITING_RULE.replace(EDITS, ")")


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)), env={})


def test_builtin_rules_pass():
    r = run("test")
    assert r.exit_code == 0, r.output
    assert "0 failed" in r.output.splitlines()[-1]


def test_local_rule_passes_then_a_broken_example_fails(tmp_path):
    (tmp_path / "scratch_rule.py").write_text(RULE)
    r = run("test", "--rules-path", tmp_path, "KVP901")
    assert r.exit_code == 0, r.output
    assert r.output.splitlines()[-1].startswith("kvpatch test: 1 rule(s)")
    # The VALID example now holds a full-pool cast the rule reports: a failure, exit 1.
    bad = RULE.replace("return scratch_kernel(q, q)",
                       "return scratch_kernel(q, fb.token_to_kv_pool.get_key_buffer(0).to(q.dtype))")
    assert bad != RULE
    (tmp_path / "broken").mkdir()  # (rule modules are cached by path within one process)
    (tmp_path / "broken" / "scratch_rule.py").write_text(bad)
    r = run("test", "--rules-path", tmp_path / "broken", "KVP901")
    assert r.exit_code == 1, r.output
    assert "FAIL KVP901-valid-0" in r.output and "must not act on VALID" in r.output


def test_a_rewrite_with_no_expected_code_fails(tmp_path):
    (tmp_path / "scratch_rule.py").write_text(REWRITING_RULE)
    r = run("test", "--rules-path", tmp_path, "scratch-kernel-cast")
    assert r.exit_code == 1 and "a report-only example must not be rewritten" in r.output


def test_unknown_rule_is_an_error():
    r = run("test", "KVP999")
    assert r.exit_code == 2 and "unknown rule" in r.output
