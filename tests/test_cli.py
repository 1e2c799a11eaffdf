"""The command line as a user runs it: help, errors, output formats, exit codes."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner

from conftest import FI_MLA, tree_hashes
from kvpatch import __version__
from kvpatch.cli.commands import main
from kvpatch.output.report import JSON_SCHEMA

COMMANDS = ["audit", "apply", "revert", "recover", "status", "rules", "verify", "test", "config"]
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def run(*args, env=None):
    return CliRunner().invoke(main, list(map(str, args)), env=env or {})


def test_version():
    r = run("--version")
    assert r.exit_code == 0 and __version__ in r.output


@pytest.mark.parametrize("cmd", COMMANDS)
def test_help_on_every_command(cmd):
    r = run(cmd, "--help")
    assert r.exit_code == 0, r.output
    assert "Example" in r.output and "Usage:" in r.output


def test_group_help_documents_completion():
    r = run("--help")
    assert r.exit_code == 0 and "_KVPATCH_COMPLETE" in r.output


def test_audit_example_table_and_exit_code(example):
    r = run("audit", example)
    assert r.exit_code == 1, r.output  # hot sites remain
    out = r.output
    assert "FlashInferMLAAttnBackend.forward_decode" in out and "FlashInferMLAAttnBackend.forward_extend" in out
    assert "no-op" in out and "unsupported" in out and "routed through the runtime" in out
    assert "files scanned" in r.output  # the summary line (stderr)


def test_audit_json_matches_schema(example):
    r = run("audit", "--json", example)
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, JSON_SCHEMA)
    assert doc["exit_code"] == 1 == r.exit_code
    by = {(s["qualname"], s["status"]) for s in doc["sites"]}
    assert ("FlashInferMLAAttnBackend.forward_decode", "hot") in by
    assert ("TorchMLABackend.forward_decode", "no-op") in by
    assert ("NpuMLABackend._kv_for_layer", "unsupported") in by
    paths = {s["qualname"]: s["path"] for s in doc["sites"]}
    assert paths["FlashInferMLAAttnBackend.forward_extend"] == "prefill"
    assert paths["FlashInferMLAAttnBackend.forward_decode"] == "decode"
    plans = doc["plan_calls"]
    assert len(plans) == 3 and {p["kv_dtype"] for p in plans} == {"self.data_type"}
    assert sorted(p["causal"] for p in plans) == ["False", "False", "True"]


def test_audit_sarif(example, tmp_path):
    out = tmp_path / "k.sarif"
    r = run("audit", "--sarif", "-o", out, example)
    assert r.exit_code == 1
    doc = json.loads(out.read_text())
    assert doc["version"] == "2.1.0"
    run0 = doc["runs"][0]
    assert {x["id"] for x in run0["tool"]["driver"]["rules"]} >= {"KVP101", "KVP102", "KVP201"}
    hot = [x for x in run0["results"] if x["level"] == "error"]
    assert hot and all(x["locations"][0]["physicalLocation"]["region"]["startLine"] > 0 for x in hot)
    assert any(x["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] == FI_MLA for x in hot)


def test_json_and_sarif_exclusive(example):
    r = run("audit", "--json", "--sarif", example)
    assert r.exit_code == 2


def test_missing_path_is_one_line_error(tmp_path):
    r = run("audit", tmp_path / "nope")
    assert r.exit_code == 2
    assert "no such file or directory" in r.output and r.output.count("\n") == 1


def test_not_an_sglang_checkout(tmp_path):
    (tmp_path / "notes.txt").write_text("hi")
    r = run("audit", tmp_path)
    assert r.exit_code == 2 and "expected an SGLang checkout" in r.output


def test_unknown_rule(example):
    r = run("audit", "--rules", "NOPE", example)
    assert r.exit_code == 2 and "unknown rule NOPE" in r.output and "KVP101" in r.output


def test_rule_selection_limits_findings(example):
    r = run("audit", "--json", "--rules", "KVP102", example)
    doc = json.loads(r.stdout)
    assert doc["plan_calls"] and all(p["rule"] == "KVP102" for p in doc["plan_calls"])
    assert all(s["rule"] != "KVP101" for s in doc["sites"])


def test_syntax_error_file_reported_others_still_scanned(example):
    bad = example / "python/sglang/srt/layers/attention/broken_backend.py"
    bad.write_text("def f(:\n    x = pool.get_key_buffer(0).to(q.dtype)\n")
    r = run("audit", "--json", example)
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert [e["file"] for e in doc["errors"]] == ["python/sglang/srt/layers/attention/broken_backend.py"]
    assert doc["errors"][0]["line"] == 1
    assert any(s["qualname"] == "FlashInferMLAAttnBackend.forward_decode" for s in doc["sites"])


def test_color_flags(example):
    always = run("--color", "always", "audit", example)
    never = run("--color", "never", "audit", example)
    assert ANSI.search(always.output) and not ANSI.search(never.output)
    auto_no_color = run("audit", example, env={"NO_COLOR": "1"})
    assert not ANSI.search(auto_no_color.output)


def test_rules_command():
    r = run("rules", "--json")
    rules = json.loads(r.output)
    assert {x["id"] for x in rules} == {"KVP101", "KVP102", "KVP103", "KVP104", "KVP105", "KVP106", "KVP107", "KVP108", "KVP201"}
    assert all(x["examples"]["invalid"] >= 1 for x in rules)
    assert "KVP101" in run("rules").output


def test_quiet_silences_summary(example):
    r = run("-q", "audit", example)
    assert "files scanned" not in r.output


def test_dry_run_writes_nothing(example):
    before = tree_hashes(example)
    r = run("apply", "--dry-run", example)
    assert r.exit_code == 0, r.output
    assert "+            k_buf = _kvpatch_rt.kv_for_mla_run(" in r.output
    # The counts first, then the diff; the runtime module is one line unless --runtime-diff.
    assert r.output.index("sites would be rewritten: 3") < r.output.index("+            k_buf = _kvpatch_rt")
    assert "plan calls retargeted: 3" in r.output and "sites skipped: 1" in r.output
    assert "--- /dev/null" not in r.output
    assert re.search(r"^added \S*_kvpatch_runtime\.py \(the runtime module, \d+ lines", r.output, re.M)
    full = run("apply", "--dry-run", "--runtime-diff", example)
    assert "--- /dev/null" in full.output and "+++ b/python/sglang/srt/layers/attention/_kvpatch_runtime.py" \
        in full.output and len(full.output) > len(r.output) + 10000
    assert tree_hashes(example) == before


def test_dry_run_colours_only_when_asked(example):
    assert ANSI.search(run("--color", "always", "apply", "--dry-run", example).output)
    assert not ANSI.search(run("apply", "--dry-run", example).output)


def test_codemod_never_imports_torch(example):
    """audit and apply --dry-run run in a process that never loads torch (or GitPython
    for a non-git tree): the core install has neither, and audit must start fast."""
    import subprocess
    import sys

    code = ("import sys\nfrom kvpatch.cli.commands import main\n"
            "for argv in (['audit', sys.argv[1]], ['apply', '--dry-run', sys.argv[1]]):\n"
            "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
            "bad = [m for m in ('torch', 'triton', 'git') if m in sys.modules]\n"
            "print('LOADED', bad)\n")
    out = subprocess.run([sys.executable, "-c", code, str(example)], capture_output=True, text=True)
    assert "LOADED []" in out.stdout, out.stdout + out.stderr


def test_rule_subset_keeps_verdicts_and_sarif_indexes_rules(example, tmp_path):
    """Issue 10 item 8: --rules picks which findings are shown, never their
    status (a gathered cast must not turn hot, a plan call must not turn
    unsupported), and each SARIF result's ruleIndex names its own rule."""
    full = json.loads(run("audit", "--json", example).stdout)
    status = {(s["file"], s["line"], s["column"]): s["status"] for s in full["sites"]}
    plan_status = {(p["file"], p["line"]): p["status"] for p in full["plan_calls"]}
    for subset in ("KVP101", "KVP102", "KVP201", "KVP101,KVP102"):
        doc = json.loads(run("audit", "--json", "--rules", subset, example).stdout)
        assert doc["sites"] or doc["plan_calls"], subset
        for s in doc["sites"]:
            assert s["rule"] in subset.split(",")
            assert s["status"] == status[(s["file"], s["line"], s["column"])], (subset, s)
        for p in doc["plan_calls"]:
            assert p["rule"] in subset.split(",")
            assert p["status"] == plan_status[(p["file"], p["line"])], (subset, p)
    for subset in (None, "KVP101"):
        out = tmp_path / f"{subset}.sarif"
        run("audit", "--sarif", "-o", out, *(["--rules", subset] if subset else []), example)
        sarif = json.loads(out.read_text())["runs"][0]
        ids = [r["id"] for r in sarif["tool"]["driver"]["rules"]]
        assert {r["ruleId"] for r in sarif["results"]} - {"KVP201"}, "the example must hold more than one rule"
        for r in sarif["results"]:
            assert ids[r["ruleIndex"]] == r["ruleId"], r


def test_a_rule_paired_with_a_left_out_rule_rewrites_nothing(example):
    """KVP102 retargets plans only next to KVP101 or KVP107 casts: with both left out
    the plans keep their verdict but apply must leave the tree as it is."""
    before = tree_hashes(example)
    doc = json.loads(run("audit", "--json", "--rules", "KVP102", example).stdout)
    assert any(p["status"] == "rewrite" and not p["fixable"] for p in doc["plan_calls"])
    r = run("apply", "--rules", "KVP102", example)
    assert r.exit_code in (0, 1), r.output
    assert tree_hashes(example) == before


def test_a_ctrl_c_while_the_interpreter_exits_prints_no_traceback():
    """Seen in CI on Python 3.10: a process-group SIGINT that lands after the command's
    last line, while the interpreter shuts down, printed a KeyboardInterrupt traceback.
    Once the command is over (done, or rolled back) there is nothing left to stop."""
    import subprocess
    import sys

    code = ("import atexit, os, signal\n"
            "import kvpatch.__main__ as m\n"
            "atexit.register(lambda: os.kill(os.getpid(), signal.SIGINT))\n"  # lands during shutdown
            "m.run(['--version'])\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert __version__ in r.stdout
    assert "Traceback" not in r.stderr and "KeyboardInterrupt" not in r.stderr, r.stderr
