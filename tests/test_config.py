"""Configuration in pyproject.toml's [tool.kvpatch] (issue 11): found walking up
from PATH, overridden by the command line, each setting shown with its source."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
from click.testing import CliRunner

from conftest import FI_MLA, git, tree_hashes
from kvpatch import config
from kvpatch.cli.commands import main
from kvpatch.output.exitcodes import EXIT_ERROR
from kvpatch.names import RULES_PATH_ENV
from test_plugin import BACKEND, REL, RULE

FA3 = "python/sglang/srt/layers/attention/flashattention_backend.py"  # KVP106's hot site (routed)


def run(*args, env=None):
    return CliRunner().invoke(main, list(map(str, args)), env=env or {})


def write_config(folder, body: str):
    path = folder / "pyproject.toml"
    path.write_text(textwrap.dedent(body))
    return path


def audit_sites(path, *args, env=None):
    r = run("audit", "--json", *args, path, env=env)
    assert r.exit_code in (0, 1), r.output
    return sorted((s["file"], s["rule"], s["status"]) for s in json.loads(r.stdout)["sites"])


# -- discovery -------------------------------------------------------------------
def test_the_first_pyproject_with_the_table_walking_up_is_used(tmp_path):
    top = write_config(tmp_path, "[tool.kvpatch]\njobs = 3\n")
    (tmp_path / "sglang" / "python" / "sglang").mkdir(parents=True)
    # SGLang's own pyproject (no [tool.kvpatch]) is skipped, the walk goes on up.
    write_config(tmp_path / "sglang" / "python", "[project]\nname = 'sglang'\n[tool.ruff]\nline-length = 120\n")
    target = tmp_path / "sglang" / "python" / "sglang"
    assert config.find(target) == (top.resolve(), {"jobs": 3})
    cfg = config.load(target)
    assert (cfg.jobs.value, cfg.jobs.source) == (3, f"{top.resolve()}: tool.kvpatch.jobs")
    # A nearer file with the table wins; the one above is not merged in.
    near = write_config(tmp_path / "sglang", "[tool.kvpatch]\nrules = ['KVP101']\n")
    cfg = config.load(target)
    assert cfg.file == near.resolve() and cfg.jobs.source == config.DEFAULT and cfg.rules.value == ["KVP101"]
    # A file PATH starts the walk at its folder.
    assert config.find(target / "x.py")[0] == near.resolve()


def test_no_config_means_the_defaults(tmp_path):
    (tmp_path / "a").mkdir()
    write_config(tmp_path, "[tool.black]\nline-length = 88\n")
    cfg = config.load(tmp_path / "a", env={})
    assert cfg.file is None
    assert [(k, s) for k, _, s in config.rows(cfg)][1:] == [
        ("rules", "default"), ("exclude", "default"), ("rules-path", "default"), ("jobs", "default"),
        ("apply.commit", "default")]


# -- precedence: command line > config > default ----------------------------------
def test_command_line_overrides_config_overrides_default(tmp_path):
    f = write_config(tmp_path, """\
        [tool.kvpatch]
        rules = "KVP101,KVP102"
        jobs = 3
        [tool.kvpatch.apply]
        commit = false
    """).resolve()
    cfg = config.load(tmp_path, env={})
    assert (cfg.rules.value, cfg.rules.source) == (["KVP101", "KVP102"], f"{f}: tool.kvpatch.rules")
    assert (cfg.jobs.value, cfg.commit.value, cfg.commit.source) == (3, False, f"{f}: tool.kvpatch.apply.commit")
    cli = config.load(tmp_path, rules=["KVP103"], jobs=5, commit=True, env={})
    assert (cli.rules.value, cli.rules.source) == (["KVP103"], "--rules")
    assert (cli.jobs.value, cli.jobs.source) == (5, "--jobs")
    assert (cli.commit.value, cli.commit.source) == (True, "--commit")


def test_config_commit_false_is_no_commit_and_commit_overrides_it(example_git):
    head = git(example_git, "rev-parse", "HEAD")
    write_config(example_git, "[tool.kvpatch.apply]\ncommit = false\n")
    git(example_git, "add", "pyproject.toml")
    git(example_git, "commit", "-qm", "kvpatch config")
    head = git(example_git, "rev-parse", "HEAD")
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    assert git(example_git, "rev-parse", "HEAD") == head  # no commit, no branch: as --no-commit
    assert git(example_git, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert "_kvpatch_rt.kv_for_mla_run" in (example_git / FI_MLA).read_text()
    r = run("revert", "--no-commit", example_git)
    assert r.exit_code == 0, r.output
    git(example_git, "checkout", "-q", "--", ".")  # the revert's own changes
    r = run("apply", "--commit", example_git)
    assert r.exit_code == 0, r.output
    assert git(example_git, "rev-parse", "--abbrev-ref", "HEAD").startswith("kvpatch/")
    assert git(example_git, "rev-parse", "HEAD") != head


# -- exclude -----------------------------------------------------------------------
def test_exclude_drops_a_hot_site_from_audit_apply_and_status(example):
    assert (FA3, "KVP106", "hot") in audit_sites(example)
    before = (example / FA3).read_bytes()
    write_config(example, f"[tool.kvpatch]\nexclude = ['{FA3}']\n")
    assert not [s for s in audit_sites(example) if s[0] == FA3]
    r = run("apply", example)
    assert r.exit_code == 0, r.output
    assert (example / FA3).read_bytes() == before  # not rewritten
    assert "_kvpatch_rt.kv_for_mla_run" in (example / FI_MLA).read_text()  # the others are
    st = run("status", example)
    assert st.exit_code == 0 and st.output.startswith("patched"), st.output
    (example / "pyproject.toml").unlink()  # without the config, the site is back
    assert run("status", example).exit_code == 1


def test_exclude_globs_are_relative_to_the_config_folder_and_exclude_folders(example_git, tmp_path):
    # The config sits above the checkout; PATH is a folder inside it; git lists the files.
    write_config(tmp_path, "[tool.kvpatch]\nexclude = ['sglang/python/**/flashattention_*.py']\n")
    inner = example_git / "python"
    assert not [s for s in audit_sites(inner) if s[0].endswith("flashattention_backend.py")]
    assert [s for s in audit_sites(inner) if s[0].endswith("flashinfer_mla_backend.py")]
    write_config(tmp_path, "[tool.kvpatch]\nexclude = ['sglang/python/sglang/srt/layers/']\n")
    assert not [s for s in audit_sites(inner) if "/layers/" in s[0]]
    assert [s for s in audit_sites(inner) if "/hardware_backend/" in s[0]]


# -- rules and rules-path ------------------------------------------------------------
def test_rules_from_config_select_as_the_option_does(example):
    every = audit_sites(example)
    by_option = audit_sites(example, "--rules", "KVP103")
    fi_mla_only = audit_sites(example, "--rules", "KVP101,KVP102")
    assert len({tuple(every), tuple(by_option), tuple(fi_mla_only)}) == 3
    write_config(example, "[tool.kvpatch]\nrules = ['page-table-pool-cast']\n")  # KVP103's name
    assert audit_sites(example) == by_option
    assert audit_sites(example, "--rules", "KVP101,KVP102") == fi_mla_only  # the option wins
    r = run("apply", "--dry-run", example)
    assert r.exit_code == 0 and "flashattention_backend.py" in r.output and FI_MLA not in r.output, r.output
    r = run("apply", "--dry-run", "--rules", "KVP101,KVP102", example)  # the option wins
    assert r.exit_code == 0 and FI_MLA in r.output and "flashattention_backend.py" not in r.output, r.output


def test_rules_path_loads_a_local_rule_for_this_command_only(example):
    folder = example / "tools" / "kvpatch_rules"
    folder.mkdir(parents=True)
    (folder / "scratch_kernel_cast.py").write_text(RULE)
    (example / REL).write_text(BACKEND)
    assert [s[1] for s in audit_sites(example) if s[0] == REL] == ["KVP201"]
    f = write_config(example, "[tool.kvpatch]\nrules-path = ['tools/kvpatch_rules']\n").resolve()
    assert [(s[1], s[2]) for s in audit_sites(example) if s[0] == REL] == [("KVP901", "hot")]
    assert RULES_PATH_ENV not in os.environ  # restored after the command
    # The same folder in the environment too loads once (no duplicate rule id).
    assert [s[1] for s in audit_sites(example, env={RULES_PATH_ENV: str(folder)}) if s[0] == REL] == ["KVP901"]
    r = run("apply", example)
    assert r.exit_code == 0, r.output
    assert "_kvpatch_rt.kv_for_scratch_kernel(" in (example / REL).read_text()
    shown = [ln for ln in run("config", example).output.splitlines() if ln.startswith("rules-path")]
    assert len(shown) == 1 and str(folder.resolve()) in shown[0], shown
    assert shown[0].endswith(f"{f}: tool.kvpatch.rules-path"), shown


# -- errors --------------------------------------------------------------------------
@pytest.mark.parametrize("body, key", [
    ("[tool.kvpatch]\njob = 3\n", "tool.kvpatch.job"),
    ("[tool.kvpatch]\njobs = 'four'\n", "tool.kvpatch.jobs"),
    ("[tool.kvpatch]\njobs = 0\n", "tool.kvpatch.jobs"),
    ("[tool.kvpatch]\njobs = true\n", "tool.kvpatch.jobs"),
    ("[tool.kvpatch]\nrules = 3\n", "tool.kvpatch.rules"),
    ("[tool.kvpatch]\nrules = ['KVP999']\n", "tool.kvpatch.rules"),
    ("[tool.kvpatch]\nexclude = 'python'\n", "tool.kvpatch.exclude"),
    ("[tool.kvpatch]\nexclude = ['../elsewhere']\n", "tool.kvpatch.exclude"),
    ("[tool.kvpatch]\nrules-path = ['no_such_folder']\n", "tool.kvpatch.rules-path"),
    ("[tool.kvpatch]\napply = true\n", "tool.kvpatch.apply"),
    ("[tool.kvpatch.apply]\ncommit = 'no'\n", "tool.kvpatch.apply.commit"),
    ("[tool.kvpatch.apply]\nmode = 'gather'\n", "tool.kvpatch.apply.mode"),
    ("[tool.kvpatch]\njobs = \n", "not valid TOML"),
])
def test_a_bad_config_is_one_line_naming_file_and_key_and_nothing_is_written(example, body, key):
    f = write_config(example, body).resolve()
    before = tree_hashes(example)
    for args in (["apply"], ["audit"], ["status"], ["config"]):
        r = run(*args, example)
        assert r.exit_code == EXIT_ERROR, (args, r.output)
        errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and str(f) in errors[0] and key in errors[0], (args, r.output)
        assert "Traceback" not in r.output
    assert tree_hashes(example) == before


# -- kvpatch config --------------------------------------------------------------------
def test_config_command_names_each_source(example, tmp_path):
    envdir = tmp_path / "env_rules"
    envdir.mkdir()
    f = write_config(example, "[tool.kvpatch]\nrules = ['KVP101']\nexclude = ['docs']\n").resolve()
    r = run("config", example / "python", env={RULES_PATH_ENV: str(envdir)})
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines()}
    assert str(f) in lines["config"]
    assert lines["rules"].endswith(f"{f}: tool.kvpatch.rules") and "KVP101" in lines["rules"]
    assert lines["exclude"].endswith(f"{f}: tool.kvpatch.exclude") and "docs" in lines["exclude"]
    assert lines["rules-path"].endswith(f"${RULES_PATH_ENV}") and str(envdir.resolve()) in lines["rules-path"]
    assert lines["jobs"].endswith("default") and lines["apply.commit"].endswith("default")
    doc = json.loads(run("config", "--json", example).stdout)
    assert {d["setting"]: d["source"] for d in doc}["rules"] == f"{f}: tool.kvpatch.rules"


# -- kvpatch rules and kvpatch test read the config too ------------------------------
def test_rules_lists_the_configs_local_rules_and_marks_the_unselected(tmp_path):
    folder = tmp_path / "tools" / "kvpatch_rules"
    folder.mkdir(parents=True)
    (folder / "scratch_kernel_cast.py").write_text(RULE)
    assert "KVP901" not in run("rules", tmp_path).output
    f = write_config(tmp_path, "[tool.kvpatch]\nrules = ['KVP101']\nrules-path = ['tools/kvpatch_rules']\n").resolve()
    r = run("rules", tmp_path)
    assert r.exit_code == 0, r.output
    lines = {ln.split()[0]: ln for ln in r.output.splitlines() if ln.startswith("KVP")}
    assert "KVP901" in lines  # the local rule, from rules-path
    assert "not selected" not in lines["KVP101"]
    assert lines["KVP901"].endswith(f"[not selected by {f}: tool.kvpatch.rules]"), lines["KVP901"]
    assert r.output.splitlines()[-1].endswith(f"; {len(lines) - 1} not selected by the config")
    doc = {d["id"]: d["selected"] for d in json.loads(run("rules", "--json", tmp_path).stdout)}
    assert doc["KVP101"] and not doc["KVP901"] and not doc["KVP102"]
    assert RULES_PATH_ENV not in os.environ  # restored after the command


def test_test_runs_the_configs_rules_and_loads_its_rules_path(tmp_path):
    folder = tmp_path / "tools" / "kvpatch_rules"
    folder.mkdir(parents=True)
    (folder / "scratch_kernel_cast.py").write_text(RULE)
    assert run("test", "--path", tmp_path, "KVP901").exit_code == 2  # unknown without the config
    write_config(tmp_path, "[tool.kvpatch]\nrules = ['KVP901']\nrules-path = ['tools/kvpatch_rules']\n")
    r = run("test", "--path", tmp_path, "KVP901")
    assert r.output.splitlines()[-1].startswith("kvpatch test: 1 rule(s), "), r.output
    r = run("test", "--path", tmp_path)  # no RULE: the config's selection, not every rule
    assert r.output.splitlines()[-1].startswith("kvpatch test: 1 rule(s), "), r.output
    assert "KVP101" not in r.output
    assert RULES_PATH_ENV not in os.environ


@pytest.mark.parametrize("cmd", ["audit", "apply"])
def test_jobs_help_says_the_config_sets_it(cmd):
    text = " ".join(run(cmd, "--help").output.split())
    assert "-j, --jobs INTEGER RANGE Worker processes (default: [tool.kvpatch] jobs in pyproject.toml" in text, text


@pytest.mark.parametrize("cmd", ["rules", "test", "config"])
def test_help_of_rules_test_and_config_says_the_config_is_read(cmd):
    text = " ".join(run(cmd, "--help").output.split())
    assert "[tool.kvpatch]" in text and "rules-path" in text, text


def test_leaving_the_routing_rule_out_gathers_the_fa3_site_instead(example):
    """KVP106 would route the FA3 call; selected out, the site goes to KVP103 (the pages
    its tables list, cast at the cast), not left hot."""
    assert (FA3, "KVP106", "hot") in audit_sites(example)
    assert (FA3, "KVP103", "hot") in audit_sites(example, "--rules", "KVP101,KVP102,KVP103")
    r = run("apply", "--rules", "KVP101,KVP102,KVP103", example)
    assert r.exit_code == 0, r.output
    text = (example / FA3).read_text()
    assert "_kvpatch_rt.kv_pages_for_kernel(" in text and "paged_attention(" not in text
    assert run("status", example).exit_code == 0
    r = run("apply", example)  # every rule: the gathered site is patched, not routed on top
    assert r.exit_code == 0 and (example / FA3).read_text() == text, r.output
