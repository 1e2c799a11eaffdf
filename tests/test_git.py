"""kvpatch in real git repositories: the user's hooks, signing, identity, index
lock, autocrlf, staged changes, non-ASCII paths (issue 10 items 1, 3, 19-22b)."""

from __future__ import annotations

import json
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import EXAMPLE, FI_MLA, git, git_init, tree_hashes
from kvpatch.checkout import repo
from kvpatch import patch as P
from kvpatch.cli.commands import main
from kvpatch.runtime import RUNTIME_FILENAME, runtime_source
from kvpatch.checkout.state import STATE_DIR

RUNTIME = FI_MLA.rsplit("/", 1)[0] + "/" + RUNTIME_FILENAME
HOOK_SAYS = "codespell-hook: _kvpatch_runtime.py:1: teh ==> the"
VERSION_PY = "python/sglang/version.py"
# SGLang's pre-commit runs these on every staged .py file, the runtime included.
FORMATTERS = {"black": ["black", "--check", "--diff"], "codespell": ["codespell_lib"]}


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def hook(repo: Path, name: str, body: str) -> None:
    p = repo / ".git" / "hooks" / name
    p.write_text("#!/bin/sh\n" + body + "\n")
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def failing_hook(repo: Path) -> None:
    hook(repo, "pre-commit", f"echo '{HOOK_SAYS}' >&2\nexit 1")


def git_state(repo: Path) -> dict:
    """Everything a failed command must leave as it was: files, index, refs, HEAD."""
    return {"files": tree_hashes(repo), "index": git(repo, "ls-files", "-s", "-z"),
            "refs": git(repo, "for-each-ref", "--format=%(refname) %(objectname)"),
            "head": git(repo, "symbolic-ref", "-q", "HEAD"), "status": git(repo, "status", "--porcelain", "-z")}


def committed_files(repo: Path) -> list:
    return sorted(git(repo, "show", "--name-only", "-z", "--format=", "HEAD").split("\0")[:-1] or [])


def planned(tree: Path) -> list:
    """What apply commits: the rewritten files, the runtimes and the state record (issue 18)."""
    b = P.build(tree)
    return sorted([r.rel for r in b.rewrites] + [rt.rel for rt in b.runtimes] + [f"{STATE_DIR}/state.json"])


def make_repo(tree: Path) -> Path:
    return git_init(tree)


# -- item 1: hooks, --no-verify, signing --------------------------------------
def test_a_failing_hook_on_apply_leaves_everything_as_before_and_shows_its_output(example_git):
    failing_hook(example_git)
    before = git_state(example_git)
    r = run("apply", example_git)
    assert r.exit_code == 2, r.output
    assert HOOK_SAYS in r.output and "--no-verify" in r.output
    assert git_state(example_git) == before
    # Nothing stuck: the same apply goes through with --no-verify, on its branch.
    expected = planned(example_git)
    r = run("apply", "--no-verify", example_git)
    assert r.exit_code == 0, r.output
    assert git(example_git, "symbolic-ref", "--short", "HEAD").startswith(repo.BRANCH_PREFIX)
    assert FI_MLA in expected and committed_files(example_git) == expected


def test_a_failing_hook_on_revert_leaves_the_patched_tree_and_no_verify_reverts(example_git):
    upstream = git(example_git, "rev-parse", "HEAD")
    assert run("apply", example_git).exit_code == 0
    failing_hook(example_git)
    before = git_state(example_git)
    r = run("revert", example_git)
    assert r.exit_code == 2, r.output
    assert HOOK_SAYS in r.output and "Traceback" not in r.output
    assert git_state(example_git) == before
    assert run("status", example_git).exit_code == 0  # still patched, nothing pending
    r = run("revert", "--no-verify", example_git)
    assert r.exit_code == 0, r.output
    assert git(example_git, "diff", upstream, "HEAD", "--stat") == ""
    assert git(example_git, "status", "--porcelain") == ""


def test_hooks_run_and_the_commit_is_signed_as_configured(example_git, tmp_path):
    ran = tmp_path / "hook-ran"
    hook(example_git, "pre-commit", f"touch '{ran}'")
    gpg = tmp_path / "fake-gpg"
    # What git needs from a signing program: a SIG_CREATED status line and a signature.
    gpg.write_text("#!/bin/sh\ncat >/dev/null\necho '[GNUPG:] SIG_CREATED D 1 8 00 0 FAKE' >&2\n"
                   "printf -- '-----BEGIN PGP SIGNATURE-----\\nfake\\n-----END PGP SIGNATURE-----\\n'\n")
    gpg.chmod(0o755)
    git(example_git, "config", "commit.gpgsign", "true")
    git(example_git, "config", "gpg.program", str(gpg))
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    assert ran.exists()
    assert "-----BEGIN PGP SIGNATURE-----" in git(example_git, "cat-file", "commit", "HEAD")


# -- item 3: the originals stay out of the commit; the state record is in it (issue 18) ----
def test_originals_stay_out_of_the_commit_the_record_is_in_it_and_the_tree_is_clean(example_git):
    upstream = git(example_git, "rev-parse", "HEAD")
    expected = planned(example_git)
    assert run("apply", example_git).exit_code == 0
    assert FI_MLA in expected and committed_files(example_git) == expected
    assert [p for p in git(example_git, "ls-files").splitlines() if p.startswith(STATE_DIR + "/")] == \
        [f"{STATE_DIR}/state.json"]
    assert git(example_git, "status", "--porcelain", "--ignored=no") == ""
    assert run("revert", example_git).exit_code == 0
    assert git(example_git, "diff", upstream, "HEAD", "--stat") == ""
    assert not (example_git / STATE_DIR).exists()
    assert git(example_git, "status", "--porcelain", "--ignored") == ""


def test_revert_of_an_older_apply_that_committed_kvpatch_removes_it_from_git(example_git):
    assert run("apply", example_git).exit_code == 0
    # What kvpatch <= 0.1 committed: .kvpatch/ as tracked files.
    (example_git / STATE_DIR / ".gitignore").unlink()
    git(example_git, "add", STATE_DIR)
    git(example_git, "commit", "-qm", "old-style kvpatch state", "--allow-empty")  # state.json: committed by apply now
    assert run("revert", example_git).exit_code == 0
    assert not [p for p in git(example_git, "ls-files").splitlines() if p.startswith(STATE_DIR + "/")]
    assert git(example_git, "status", "--porcelain") == ""


def test_the_branch_is_named_as_the_readme_says(example_git):
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"`{repo.BRANCH_PREFIX}v<sglang version>-<7-character sha>`" in readme
    assert f"`{repo.BRANCH_PREFIX}<10-character sha>`" in readme
    sha = git(example_git, "rev-parse", "HEAD")
    assert run("apply", "--no-commit", example_git).exit_code == 0  # the versioned form
    info = repo.git_info(example_git)
    assert repo.branch_name(info, example_git) == f"{repo.BRANCH_PREFIX}v0.0.0.kvpatch-example-{sha[:7]}"
    (example_git / VERSION_PY).write_text('__version__ = "0.0.0.dev0"\n')  # a setuptools-scm fallback
    assert repo.branch_name(info, example_git) == f"{repo.BRANCH_PREFIX}{sha[:10]}"


# -- item 19: --allow-dirty commits kvpatch's own paths only ------------------------
def test_allow_dirty_keeps_the_users_staged_change_staged_and_out_of_the_commit(example_git):
    (example_git / VERSION_PY).write_text('__version__ = "0.0.0.kvpatch-example"\n# mine\n')
    (example_git / "README.md").write_text("my staged note\n")
    git(example_git, "add", VERSION_PY, "README.md")
    expected = planned(example_git)
    r = run("apply", "--allow-dirty", example_git)
    assert r.exit_code == 0, r.output
    assert FI_MLA in expected and committed_files(example_git) == expected
    assert git(example_git, "diff", "--cached", "--name-only").splitlines() == ["README.md", VERSION_PY]


# -- item 20: core.autocrlf -------------------------------------------------------
def test_autocrlf_commits_the_blob_git_itself_would_store(example_git):
    git(example_git, "config", "core.autocrlf", "true")
    for p in git(example_git, "ls-files").splitlines():
        (example_git / p).unlink()
    git(example_git, "checkout", "--", ".")  # the working tree now has CRLF, as on Windows
    assert b"\r\n" in (example_git / FI_MLA).read_bytes()
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    for p in (FI_MLA, RUNTIME):
        # Bytes: text mode would turn CRLF into LF on the way here.
        blob = subprocess.run(["git", "-C", str(example_git), "cat-file", "blob", f"HEAD:{p}"], check=True,
                              capture_output=True).stdout
        assert b"\r" not in blob and blob.count(b"\n") > 10, p
    assert git(example_git, "status", "--porcelain") == ""


# -- item 21: identity --------------------------------------------------------------
def test_no_identity_with_use_config_only_is_refused_as_git_refuses(example_git, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "no-global-config"))
    for var in ("GIT_AUTHOR_NAME", "GIT_AUTHOR_EMAIL", "GIT_COMMITTER_NAME", "GIT_COMMITTER_EMAIL", "EMAIL"):
        monkeypatch.delenv(var, raising=False)
    git(example_git, "config", "--unset", "user.name")
    git(example_git, "config", "--unset", "user.email")
    git(example_git, "config", "user.useConfigOnly", "true")
    before = git_state(example_git)
    r = run("apply", example_git)
    assert r.exit_code == 2, r.output
    assert "no email was given and auto-detection is disabled" in r.output
    assert git_state(example_git) == before


# -- item 22: index.lock ------------------------------------------------------------
def test_an_index_lock_fails_in_one_line_and_leaves_no_branch(example_git):
    (example_git / ".git" / "index.lock").write_bytes(b"")
    before = git_state(example_git)
    r = run("apply", example_git)
    assert r.exit_code == 2, r.output
    errors = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "index.lock" in errors[0], r.output
    assert "cmdline" not in r.output and "stderr:" not in r.output
    assert git_state(example_git) == before


# -- item 22a: untracked inside an unrelated repository ---------------------------------
def test_a_tree_untracked_in_an_unrelated_repository_is_a_plain_directory(tmp_path):
    dotfiles = tmp_path / "dotfiles"
    dotfiles.mkdir()
    (dotfiles / ".bashrc").write_text("# mine\n")
    make_repo(dotfiles)
    tree = dotfiles / "sglang"
    shutil.copytree(EXAMPLE, tree)
    before = git_state(dotfiles)
    r = run("apply", tree)
    assert r.exit_code == 0, r.output
    assert "not tracked by the git repository" in r.output and "plain directory" in r.output
    after = git_state(dotfiles)
    assert (after["refs"], after["head"], after["index"]) == (before["refs"], before["head"], before["index"])
    assert "_kvpatch_rt.kv_for_mla_run" in (tree / FI_MLA).read_text()
    assert run("revert", tree).exit_code == 0
    assert tree_hashes(tree) == tree_hashes(EXAMPLE)


# -- item 22b: non-ASCII and quoted paths ---------------------------------------------
@pytest.mark.parametrize("folder", ["modèles", 'we"ird\tname', "*"])
def test_non_ascii_and_quoted_paths_revert_cleanly(tmp_path, folder):
    repo = tmp_path / "repo"
    shutil.copytree(EXAMPLE, repo / folder / "sglang")
    make_repo(repo)
    upstream = git(repo, "rev-parse", "HEAD")
    tree = repo / folder / "sglang"
    expected = planned(tree)
    r = run("apply", tree)
    assert r.exit_code == 0, r.output
    assert sorted(committed_files(repo)) == sorted(f"{folder}/sglang/{p}" for p in expected)
    r = run("revert", tree)
    assert r.exit_code == 0, r.output
    assert git(repo, "diff", upstream, "HEAD", "--stat") == ""
    assert git(repo, "status", "--porcelain", "--ignored") == ""


# -- item 2: the file list comes from git ------------------------------------------------
def ignored_build_copy(repo: Path) -> str:
    build = "python/build/lib/sglang"
    shutil.copytree(repo / "python/sglang", repo / build)
    (repo / ".gitignore").write_text("build/\n")
    return build


def site_files(root: Path) -> set:
    r = run("audit", "--json", root)
    return {s["file"] for s in json.loads(r.output[:r.output.rindex("}") + 1])["sites"]}


def test_git_ignored_copies_are_not_scanned_or_patched(example_git):
    build = ignored_build_copy(example_git)
    git(example_git, "add", ".gitignore")
    git(example_git, "commit", "-qm", "ignore build/")
    untracked = example_git / "python/sglang/srt/new_backend.py"  # untracked, not ignored: scanned
    shutil.copy(example_git / FI_MLA, untracked)
    files = site_files(example_git)
    assert FI_MLA in files and "python/sglang/srt/new_backend.py" in files
    assert not [f for f in files if f.startswith(build)]
    untracked.unlink()
    copy_before = tree_hashes(example_git / build)
    expected = planned(example_git)
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    assert tree_hashes(example_git / build) == copy_before
    assert FI_MLA in expected and committed_files(example_git) == expected


def test_outside_git_every_file_is_walked(example):
    build = ignored_build_copy(example)
    assert f"{build}/srt/layers/attention/flashinfer_mla_backend.py" in site_files(example)


# -- item 1: the injected runtime passes SGLang's own formatter hooks --------------------
@pytest.mark.parametrize("tool", sorted(FORMATTERS))
def test_the_injected_runtime_is_black_and_codespell_clean(tmp_path, tool):
    module, *args = FORMATTERS[tool]
    pytest.importorskip(module, reason=f"{tool} is not installed (the test extras pin it: pip install '.[test]')")
    injected = tmp_path / RUNTIME_FILENAME
    injected.write_text(runtime_source(), encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", module, *args, str(injected)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# -- issue 9: one git module ----------------------------------------------------------
def _git_access(path: Path) -> list:
    """Where a module imports GitPython, or runs the git binary itself."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "git" for a in node.names):
            found.append(f"{node.lineno}: import git")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "git":
            found.append(f"{node.lineno}: from git")
        elif isinstance(node, (ast.List, ast.Tuple)) and node.elts and isinstance(node.elts[0], ast.Constant) \
                and node.elts[0].value == "git":
            found.append(f"{node.lineno}: a ['git', ...] command line")
    return found


def test_kvpatch_git_is_the_only_module_that_runs_git():
    pkg = Path(__file__).resolve().parents[1] / "kvpatch"
    one = pkg / "checkout" / "git.py"
    assert _git_access(one)  # the check can see an access: kvpatch.checkout.git imports GitPython
    others = {p.relative_to(pkg).as_posix(): _git_access(p) for p in sorted(pkg.rglob("*.py")) if p != one}
    assert {rel: hits for rel, hits in others.items() if hits} == {}
