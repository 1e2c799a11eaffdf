"""`kvpatch apply -i`, driven through a real pseudo-terminal (as a person at a shell).

The tree: the bundled example (an FA3 site, KVP106; a FlashInfer MLA file whose two
KVP101 casts and three KVP102 plan calls go together) plus MUSA's backend (two KVP106
sites) in a folder of its own. The changes are asked in file order:
  1. MUSA forward_extend   2. MUSA forward_decode   3. FA3 forward_decode
  4. the FlashInfer MLA file (2 casts + 3 plan calls, one question)
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FI_MLA, REPO, git, git_init, tree_hashes
from kvpatch.runtime import RUNTIME_FILENAME

pty = pytest.importorskip("pty", reason="apply -i is driven through a POSIX pseudo-terminal")
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no pty on Windows")

MUSA = "python/sglang/srt/hardware_backend/musa/attention/flashattention_backend.py"
FA3 = "python/sglang/srt/layers/attention/flashattention_backend.py"
LAYERS_RT = "python/sglang/srt/layers/attention/" + RUNTIME_FILENAME
MUSA_RT = "python/sglang/srt/hardware_backend/musa/attention/" + RUNTIME_FILENAME
PROMPT = b"Apply this change? [y]es / [n]o / [a]ll remaining / [q]uit"


@pytest.fixture
def tree(example) -> Path:
    (example / MUSA).parent.mkdir(parents=True)
    shutil.copy(REPO / "tests/data/musa" / MUSA, example / MUSA)
    return example


@pytest.fixture
def tree_git(tree) -> Path:
    return git_init(tree)


def spawn(*args: str):
    """`python -m kvpatch ARGS` (this checkout's) with a pty as its stdin, stdout and stderr."""
    pid, fd = pty.fork()
    if pid == 0:
        try:
            os.chdir(REPO)
            os.execv(sys.executable, [sys.executable, "-m", "kvpatch", *args])
        finally:
            os._exit(127)
    return pid, fd


def drive(root: Path, answers, *extra: str, timeout: float = 120.0):
    """Run `kvpatch apply -i ROOT` on a pty; answer each prompt in turn.
    Returns (exit code, everything the terminal showed, how many prompts)."""
    pid, fd = spawn("--color", "never", "apply", "-i", *extra, str(root))
    answers, out, asked = list(answers), b"", 0
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
            while out.count(PROMPT) > asked:
                asked += 1
                if not answers:
                    raise AssertionError(f"prompt {asked} was not expected:\n{out.decode(errors='replace')}")
                os.write(fd, answers.pop(0).encode() + b"\n")
        else:
            raise AssertionError(f"apply -i did not finish:\n{out.decode(errors='replace')}")
    except BaseException:  # an assertion above: end the child, then report
        os.kill(pid, 9)
        raise
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert not answers, f"answers left unused: {answers}\n{out.decode(errors='replace')}"
    return os.waitstatus_to_exitcode(status), out.decode(errors="replace").replace("\r\n", "\n"), asked


def kvpatch(*args, root: Path):
    return subprocess.run([sys.executable, "-m", "kvpatch", *args, str(root)], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, cwd=REPO)


def state(root: Path) -> dict:
    return json.loads((root / ".kvpatch/state.json").read_text())


def all_compile(root: Path) -> None:
    for p in root.rglob("*.py"):
        compile(p.read_text(), str(p), "exec")


def test_yes_no_mix_writes_only_the_accepted_and_records_the_declined(tree):
    before = tree_hashes(tree)
    rc, out, asked = drive(tree, ["n", "n", "y", "y"])
    assert rc == 0, out
    assert asked == 4 and "[4/4] " + FI_MLA in out
    assert "changes accepted: 2 of 4; declined: 2" in out
    # The FlashInfer MLA file is one question: both casts and the three plan calls.
    fi_block = out[out.index("[4/4]"):]
    assert fi_block.count(" cast [KVP107]") == 2 and fi_block.count(" plan call [KVP102]") == 3
    after = tree_hashes(tree)
    assert after[MUSA] == before[MUSA]  # declined: its bytes are the original ones
    assert after[FA3] != before[FA3] and after[FI_MLA] != before[FI_MLA]
    assert LAYERS_RT in after and MUSA_RT not in after  # no runtime where nothing was accepted
    all_compile(tree)
    declined = state(tree)["declined"]
    assert [(d["file"], d["qualname"], d["kind"]) for d in declined] == [
        (MUSA, "MusaFlashAttentionBackend.forward_extend", "cast"),
        (MUSA, "MusaFlashAttentionBackend.forward_decode", "cast")]
    st = kvpatch("status", root=tree)
    assert st.returncode == 0, st.stdout + st.stderr  # not "partly patched"
    assert st.stdout.startswith("patched: 2 site(s) declined")
    assert "MusaFlashAttentionBackend.forward_decode: declined" in st.stdout

    # A second apply -i offers the declined ones only.
    rc, out, asked = drive(tree, ["y", "n"])
    assert rc == 0 and asked == 2, out
    assert "[1/2] " + MUSA in out and "[2/2] " + MUSA in out and FA3 not in out
    assert MUSA_RT in tree_hashes(tree)  # now one MUSA site is accepted
    assert "_kvpatch_rt.paged_attention(" in (tree / MUSA).read_text()  # KVP106 routed its calls
    assert [d["qualname"] for d in state(tree)["declined"]] == ["MusaFlashAttentionBackend.forward_decode"]
    st = kvpatch("status", root=tree)
    assert st.returncode == 0 and st.stdout.startswith("patched: 1 site(s) declined"), st.stdout

    # A plain apply rewrites the declined ones too; the record then holds no decline.
    r = kvpatch("apply", root=tree)
    assert r.returncode == 0 and "sites rewritten: 1" in r.stdout, r.stdout + r.stderr
    assert "declined" not in state(tree)
    st = kvpatch("status", root=tree)
    assert st.returncode == 0 and "declined" not in st.stdout
    all_compile(tree)
    # revert takes every apply back to the original bytes
    assert kvpatch("revert", root=tree).returncode == 0
    assert tree_hashes(tree) == before


def test_in_git_one_commit_with_the_accepted_files_only(tree_git):
    head = git(tree_git, "rev-parse", "HEAD")
    rc, out, _ = drive(tree_git, ["y", "n", "n", "n"])
    assert rc == 0, out
    assert git(tree_git, "rev-list", "--count", f"{head}..HEAD") == "1"
    changed = git(tree_git, "diff", "--name-only", head, "HEAD").splitlines()
    assert changed == [".kvpatch/state.json", MUSA_RT, MUSA]  # the accepted site's file, its runtime, the record
    assert git(tree_git, "status", "--porcelain") == ""
    assert "declined" in git(tree_git, "log", "-1", "--format=%B")
    assert len(state(tree_git)["declined"]) == 1 + 1 + 5  # MUSA decode, FA3, FlashInfer MLA's 2 casts + 3 plans
    st = kvpatch("status", root=tree_git)
    assert st.returncode == 0 and st.stdout.startswith("patched: 4 site(s) and 3 plan call(s) declined"), st.stdout
    all_compile(tree_git)


def test_declining_the_paired_flashinfer_change_leaves_its_file_whole(tree):
    before = tree_hashes(tree)
    rc, out, _ = drive(tree, ["y", "y", "y", "n"])
    assert rc == 0, out
    assert tree_hashes(tree)[FI_MLA] == before[FI_MLA]  # neither the casts nor the plan calls
    assert "plan calls retargeted: 0" in out


def test_quit_writes_what_was_accepted_so_far(tree):
    before = tree_hashes(tree)
    rc, out, asked = drive(tree, ["n", "y", "q"])
    assert rc == 0 and asked == 3, out
    assert "changes accepted: 1 of 4; declined: 1; not asked (quit): 2" in out
    after = tree_hashes(tree)
    assert after[MUSA] != before[MUSA] and after[FA3] == before[FA3] and after[FI_MLA] == before[FI_MLA]
    # Only the "no" is recorded; what quit left unasked is still to do.
    assert [d["qualname"] for d in state(tree)["declined"]] == ["MusaFlashAttentionBackend.forward_extend"]
    st = kvpatch("status", root=tree)
    assert st.returncode == 1 and st.stdout.startswith("partly patched"), st.stdout
    assert "FlashAttentionBackend.forward_decode: not rewritten yet" in st.stdout
    assert "MusaFlashAttentionBackend.forward_extend: not rewritten yet" not in st.stdout


@pytest.mark.parametrize("answers", [["q"], ["n", "n", "n", "n"]])
def test_nothing_accepted_writes_nothing(tree_git, answers):
    before, head = tree_hashes(tree_git), git(tree_git, "rev-parse", "HEAD")
    rc, out, _ = drive(tree_git, answers)
    assert rc == 0 and "nothing written" in out, out
    assert tree_hashes(tree_git) == before and not (tree_git / ".kvpatch").exists()
    assert git(tree_git, "rev-parse", "HEAD") == head
    assert git(tree_git, "rev-parse", "--abbrev-ref", "HEAD") == "main"


def test_all_accepts_this_one_and_every_later_one(tree):
    before = tree_hashes(tree)
    rc, out, asked = drive(tree, ["n", "a"])
    assert rc == 0 and asked == 2, out  # nothing asked after `a`
    assert "changes accepted: 3 of 4; declined: 1" in out
    after = tree_hashes(tree)
    assert all(after[f] != before[f] for f in (MUSA, FA3, FI_MLA))
    assert MUSA_RT in after and LAYERS_RT in after
    assert "_kvpatch_rt.paged_attention(" in (tree / MUSA).read_text()  # KVP106 routed its calls
    assert (tree / MUSA).read_text().count(".to(q.dtype)") == 1  # forward_extend kept its cast
    all_compile(tree)


def test_a_bad_answer_asks_again_and_the_hunk_is_the_sites_own(tree):
    rc, out, asked = drive(tree, ["maybe", "q"])
    assert rc == 0 and asked == 2, out
    assert "please answer y, n, a or q" in out
    first = out[out.index("[1/4]"):out.index(PROMPT.decode())]
    assert "-        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)" in first
    # forward_extend's cast and the one kernel call it routes, not forward_decode's
    assert first.count("\n-  ") == 2 and "-        o = flash_attn_with_kvcache(" in first
    assert "import _kvpatch_runtime" not in first and "runtime import" in first


def test_hunks_are_coloured_like_the_dry_run(tree):
    pid, fd = spawn("--color", "always", "apply", "-i", str(tree))
    out = b""
    try:
        while PROMPT not in out:
            ready, _, _ = select.select([fd], [], [], 60)
            assert ready, out
            out += os.read(fd, 65536)
        os.write(fd, b"q\n")
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
    finally:
        os.waitpid(pid, 0)
        os.close(fd)
    assert b"\x1b[31m-        kv_cache = " in out and b"\x1b[32m+        kv_cache = " in out


def test_refused_without_a_terminal(tree):
    before = tree_hashes(tree)
    r = kvpatch("apply", "-i", root=tree)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines()[0] == ("error: --interactive reads its answers from a terminal, and stdin is not "
                                        "one (run `kvpatch apply` without -i)")
    assert tree_hashes(tree) == before


def test_refused_with_dry_run_and_on_a_dirty_tree_before_any_question(tree_git):
    rc, out, asked = drive(tree_git, [], "--dry-run")
    assert rc == 2 and asked == 0 and "--interactive and --dry-run exclude each other" in out
    (tree_git / FA3).write_text((tree_git / FA3).read_text() + "\n# mine\n")
    rc, out, asked = drive(tree_git, [])
    assert rc == 2 and asked == 0 and "uncommitted changes" in out


def test_changes_pair_linked_rules_and_split_the_rest(tree):
    """The grouping itself: linked rules (PAIRS_WITH / NEEDS_ALL) in one file are one change."""
    from kvpatch.rewrite import choose
    from kvpatch.engine import analyze_source
    from kvpatch.rewrite.transform import plan_rewrite
    from kvpatch.rule import load_rules

    rules = load_rules()
    fi = analyze_source(FI_MLA, (tree / FI_MLA).read_bytes(), rules)
    got = choose.changes(fi, rules, plan_rewrite(fi, rules))
    assert len(got) == 1 and len(got[0].casts) == 2 and len(got[0].plans) == 3
    musa = analyze_source(MUSA, (tree / MUSA).read_bytes(), rules)
    got = choose.changes(musa, rules, plan_rewrite(musa, rules))
    assert [c.casts[0].qualname for c in got] == ["MusaFlashAttentionBackend.forward_extend",
                                                  "MusaFlashAttentionBackend.forward_decode"]
    # Each change alone leaves the other fixable, and both together are the whole rewrite.
    assert choose.accepted_rewrite(musa, rules, got).new_text == plan_rewrite(musa, rules).new_text
    assert got[0].alone.new_text.count(".to(q.dtype)") == 1


def test_hunks_after_the_hidden_import_are_numbered_without_it(tree):
    """Each change's hunk hides the runtime import's hunk: the later hunks' new-side
    line numbers must not count its lines (a consistent diff of the file without it)."""
    import re

    from kvpatch.rewrite import choose
    from kvpatch.engine import analyze_source
    from kvpatch.rewrite.transform import plan_rewrite
    from kvpatch.rule import load_rules

    rules = load_rules()
    musa = analyze_source(MUSA, (tree / MUSA).read_bytes(), rules)
    got = choose.changes(musa, rules, plan_rewrite(musa, rules))
    assert len(got) == 2 and all(c.adds_import for c in got)
    for c in got:
        old = c.alone.old_text.splitlines()
        hunk = c.hunk()
        heads = list(re.finditer(r"^@@ -(\d+),(\d+) \+(\d+),(\d+) @@", hunk, re.M))
        assert heads and "import _kvpatch_runtime" not in hunk
        delta = 0
        for m in heads:
            o_start, o_len, n_start, n_len = map(int, m.groups())
            assert n_start == o_start + delta, hunk  # before the fix: 2 more (the import and its blank line)
            body = hunk[m.end():].split("\n@@", 1)[0].strip("\n").split("\n")
            old_side = [ln[1:] for ln in body if ln[:1] in (" ", "-")]
            assert old[o_start - 1:o_start - 1 + o_len] == old_side
            delta += n_len - o_len
