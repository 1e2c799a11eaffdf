"""apply / revert / status end to end, in a plain directory and in git."""

from __future__ import annotations

import json

import pytest

from click.testing import CliRunner

from conftest import FI_MLA, REPO, git, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.runtime import RUNTIME_FILENAME

GOLDEN = REPO / "tests" / "golden" / "flashinfer_mla_backend.patched.py"
RUNTIME = FI_MLA.rsplit("/", 1)[0] + "/" + RUNTIME_FILENAME
FA3 = FI_MLA.rsplit("/", 1)[0] + "/flashattention_backend.py"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def test_apply_plain_dir_matches_golden_and_is_idempotent(example):
    original = tree_hashes(example)
    r = run("apply", example)
    assert r.exit_code == 0, r.output
    assert "not a git checkout" in r.output
    assert (example / FI_MLA).read_text() == GOLDEN.read_text()
    compile((example / FI_MLA).read_text(), FI_MLA, "exec")
    rt = example / RUNTIME
    compile(rt.read_text(), RUNTIME, "exec")
    assert '__kvpatch_version__ = "' in rt.read_text()
    state = json.loads((example / ".kvpatch/state.json").read_text())
    assert state["schema"] == "kvpatch.state/1"
    files = {f["path"]: f for f in state["files"]}
    assert set(files) == {FI_MLA, FA3}  # the FlashInfer MLA backend and the FA3 one (KVP103)
    f = files[FI_MLA]
    assert len(f["sites"]) == 5 and len(files[FA3]["sites"]) == 1
    assert {s["kind"] for s in f["sites"]} == {"cast", "plan"}
    assert all(s["rewritten"] and s["original"] != s["rewritten"] for s in f["sites"])
    assert (example / f["original_copy"]).read_bytes() == (REPO / "examples/sglang" / FI_MLA).read_bytes()

    patched = tree_hashes(example)
    again = run("apply", example)
    assert again.exit_code == 0 and "nothing to do" in again.output
    assert tree_hashes(example) == patched

    st = run("status", "--json", example)
    assert st.exit_code == 0 and json.loads(st.stdout)["state"] == "patched"

    audit = run("audit", "--json", example)
    sites = json.loads(audit.stdout)["sites"]
    assert {s["status"] for s in sites if s["file"] == FI_MLA} == {"patched"}
    assert audit.exit_code == 1  # FA3 and NPU sites remain: no rule rewrites them

    rv = run("revert", example)
    assert rv.exit_code == 0, rv.output
    assert tree_hashes(example) == original


def test_status_not_patched_then_drift(example):
    st = run("status", example)
    assert st.exit_code == 1 and st.output.startswith("not patched")
    assert run("apply", example).exit_code == 0
    p = example / FI_MLA
    # An edit inside forward_decode's rewritten cast (its dtype argument).
    p.write_text(p.read_text().replace("            q.dtype,  # FP8",
                                       "            q_nope.dtype,  # FP8", 1))
    st = run("status", example)
    assert st.exit_code == 3 and st.output.startswith("drifted")
    assert "FlashInferMLAAttnBackend.forward_decode" in st.output
    rv = run("revert", example)
    assert rv.exit_code == 2 and "--force" in rv.output
    rv = run("revert", "--force", example)
    assert rv.exit_code == 0
    assert p.read_bytes() == (REPO / "examples/sglang" / FI_MLA).read_bytes()
    assert (example / (FI_MLA + ".kvpatch-drifted")).exists()  # the hand edit is kept


def test_apply_in_git_makes_branch_and_one_commit(example_git):
    head = git(example_git, "rev-parse", "HEAD")
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    branch = git(example_git, "rev-parse", "--abbrev-ref", "HEAD")
    assert branch.startswith("kvpatch/v0.0.0.kvpatch-example-")
    assert git(example_git, "rev-parse", "HEAD~1") == head
    assert git(example_git, "status", "--porcelain") == ""
    msg = git(example_git, "log", "-1", "--format=%B")
    assert "FlashInferMLAAttnBackend.forward_decode" in msg and "forward_extend" in msg
    assert "plan kv dtype" in msg and RUNTIME in msg
    files = git(example_git, "show", "--name-only", "--format=", "HEAD").splitlines()
    assert FI_MLA in files and RUNTIME in files
    # The originals stay out of the commit (issue 10 item 3); the record is in it (issue 18).
    assert [f for f in files if f.startswith(".kvpatch/")] == [".kvpatch/state.json"]

    again = run("apply", example_git)
    assert "nothing to do" in again.output and git(example_git, "rev-parse", "HEAD") != head
    assert git(example_git, "rev-list", "--count", "HEAD") == "2"

    rv = run("revert", example_git)
    assert rv.exit_code == 0, rv.output
    assert git(example_git, "status", "--porcelain") == ""
    assert git(example_git, "diff", head, "HEAD", "--stat") == ""  # bytes back to upstream


def test_dirty_tree_refused_unless_allowed(example_git):
    other = example_git / "python/sglang/version.py"
    other.write_text(other.read_text() + "# local edit\n")
    before = tree_hashes(example_git)
    r = run("apply", example_git)
    assert r.exit_code == 2 and "uncommitted changes" in r.output and "--allow-dirty" in r.output
    assert tree_hashes(example_git) == before
    r = run("apply", "--allow-dirty", example_git)
    assert r.exit_code == 0, r.output
    assert "version.py" in git(example_git, "status", "--porcelain")  # the user's edit stays uncommitted


def test_no_commit_writes_files_only(example_git):
    head = git(example_git, "rev-parse", "HEAD")
    r = run("apply", "--no-commit", example_git)
    assert r.exit_code == 0 and "--no-commit" in r.output
    assert git(example_git, "rev-parse", "HEAD") == head
    assert git(example_git, "rev-parse", "--abbrev-ref", "HEAD") == "main"
    assert "_kvpatch_rt.kv_for_mla_run" in (example_git / FI_MLA).read_text()


def test_refused_file_leaves_everything_original(example, monkeypatch):
    """A rewrite that fails its compile check is reported and nothing is written."""
    from kvpatch.rewrite import transform as rewrite

    def broken(*a, **k):
        raise rewrite.RewriteError("forced failure")

    monkeypatch.setattr(rewrite, "_check", broken)
    before = tree_hashes(example)
    r = run("apply", example)
    assert r.exit_code == 2 and "forced failure" in r.output
    assert tree_hashes(example) == before


def test_revert_without_record(example):
    r = run("revert", example)
    assert r.exit_code == 2 and "was not patched" in r.output


def test_verify_command_on_an_applied_checkout(example):
    """`kvpatch verify` end to end through the CLI: apply, then verify (CPU reference
    path here), then a broken plan: verify must fail, naming the site."""
    pytest.importorskip("torch", reason="verify needs torch (pip install kvpatch[test])")
    assert run("apply", example).exit_code == 0
    ok = run("verify", "--cpu", "--quick", "--mode", "gather", example)
    assert ok.exit_code == 0, ok.output
    assert "passed" in ok.output and "FAIL" not in ok.output
    no_gpu = run("verify", "--quick", "--mode", "gather", example)
    assert no_gpu.exit_code == 3 and "no GPU check" in no_gpu.output  # CPU passed, GPU not run
    p = example / FI_MLA
    text = p.read_text()
    broken = text.replace("""                _kvpatch_rt.plan_kv_dtype(
                    wrapper,
                    self.data_type,
                    self.data_type,
                    self._kvpatch_kv_cache_dtype,
                    False,
                ),""", "                torch.float8_e4m3fn,", 1)
    assert broken != text
    p.write_text(broken)
    bad = run("verify", "--cpu", "--quick", "--mode", "gather", example)
    assert bad.exit_code == 1, bad.output
    assert "FlashInferMLAAttnBackend.forward_decode" in bad.output and "kv_data_type" in bad.output


def test_verify_without_a_patch(example):
    pytest.importorskip("torch", reason="verify needs torch (pip install kvpatch[test])")
    r = run("verify", "--cpu", "--quick", example)
    assert r.exit_code == 2 and "no patched file found" in r.output


def test_an_edit_outside_the_patched_regions_is_not_drift(example):
    """Issue 10 item 5: a comment added on line 1 of a patched file left every region
    intact, yet status said drifted (state.json keeps the statements dedented)."""
    assert run("apply", example).exit_code == 0
    p = example / FI_MLA
    p.write_text("# a note of the user's\n" + p.read_text())
    st = run("status", "--json", example)
    assert st.exit_code == 0 and json.loads(st.stdout)["state"] == "patched", st.output
    # ... while an edit inside a patched region still is.
    p.write_text(p.read_text().replace("_kvpatch_rt.kv_for_mla_run(", "_kvpatch_rt.kv_for_mla_run_x(", 1))
    st = run("status", "--json", example)
    assert st.exit_code == 3 and json.loads(st.stdout)["state"] == "drifted", st.output


def test_an_edited_routed_call_is_drift(example):
    """The routed run() is part of the rewrite: put back to the wrapper's own run() by hand,
    it would hand the FP8 pool to a kernel planned for bf16. status says drifted, naming it."""
    assert run("apply", example).exit_code == 0
    p = example / FI_MLA
    text = p.read_text()
    routed = "        o = _kvpatch_rt.mla_run(\n            decode_wrapper.run,\n"
    assert text.count(routed) == 1
    p.write_text(text.replace(routed, "        o = decode_wrapper.run(\n", 1))
    st = run("status", example)
    assert st.exit_code == 3 and st.output.startswith("drifted"), st.output
    assert "FlashInferMLAAttnBackend.forward_decode: a call its rewrite routed was edited" in st.output
    state = json.loads((example / ".kvpatch/state.json").read_text())
    sites = [s for f in state["files"] for s in f["sites"]]
    # Only a site whose rewrite changed another statement records it.
    assert all(("also" in s) == (s["rule"] in ("KVP106", "KVP107")) for s in sites), sites
