"""Hardening: status end to end, interrupted writes, bad inputs, formatting.

Every bad input must give a clear one-line error, the documented exit code,
and leave every file as it was. An apply killed at any point (kill -9 via the
KVPATCH_TEST_CRASH_AFTER hook, or SIGINT/SIGTERM while paused in the write
loop via KVPATCH_TEST_PAUSE_AFTER) must leave a tree that `status` calls
interrupted and `recover` brings back byte for byte, or roll itself back.
"""

from __future__ import annotations

import hashlib
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import FI_MLA, REPO, git
from kvpatch.cli.commands import main

EXAMPLE = REPO / "examples" / "sglang"
RUNTIME = FI_MLA.rsplit("/", 1)[0] + "/_kvpatch_runtime.py"
COMMANDS = ["audit", "apply", "status", "revert", "recover"]


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def kvpatch_subprocess(*args, env=None, **kw):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVPATCH_TEST_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvpatch", "--color", "never", *map(str, args)],
                          capture_output=True, text=True, env=full_env, **kw)


def snapshot(root: Path) -> dict:
    """Every file's sha256, every directory and every link under root (.git excluded)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        if ".git" in rel_dir.parts:
            continue
        for d in dirnames:
            p = Path(dirpath) / d
            rel = (rel_dir / d).as_posix()
            if rel.split("/")[0] == ".git":
                continue
            out[rel + "/"] = "link:" + os.readlink(p) if p.is_symlink() else "dir"
        for f in filenames:
            p = Path(dirpath) / f
            rel = (rel_dir / f).as_posix()
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            else:
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() + f":{oct(p.stat().st_mode & 0o777)}"
    return out


def one_error_line(result) -> str:
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error: ")]
    assert len(errs) == 1, result.output
    assert "Traceback" not in result.output
    return errs[0]


@pytest.fixture
def tree(example) -> Path:
    return example  # conftest.py: a copy of examples/sglang


def n_writes(root: Path) -> int:
    """How many replacements a first apply of root makes (counted from the patch it would write)."""
    from kvpatch import patch as P

    from kvpatch.checkout import repo

    built = P.build(root)
    # Original copies only where git does not have the originals (a clean git tree has them all).
    copies = 0 if repo.git_info(root) is not None else len(built.rewrites)
    return copies + len(built.rewrites) + len(built.runtimes) + 1  # + rewrites + runtimes + state.json


# -- status, end to end -------------------------------------------------------------
def test_status_through_a_patch_life(tree):
    original = snapshot(tree)
    st = run("status", "--json", tree)
    assert st.exit_code == 1 and json.loads(st.stdout)["state"] == "not patched"
    assert run("apply", tree).exit_code == 0
    patched = snapshot(tree)
    st = run("status", tree)
    assert st.exit_code == 0 and st.stdout.startswith("patched")

    # A hand edit inside a rewritten region: drifted, exit 3, naming the site.
    p = tree / FI_MLA
    text = p.read_text()
    site = "            q.dtype,  # FP8 storage -> query dtype\n"
    assert text.count(site) == 1
    p.write_text(text.replace(site, site.replace("q.dtype,", "q_nope.dtype,")))
    edited = snapshot(tree)
    st = run("status", "--json", tree)
    doc = json.loads(st.stdout)
    assert st.exit_code == 3 and doc["state"] == "drifted" and doc["exit_code"] == 3
    assert any(pl["file"] == FI_MLA and "FlashInferMLAAttnBackend.forward_decode" in pl["what"] and pl["line"]
               for pl in doc["places"])

    # revert refuses without --force, and the refusal writes nothing
    rv = run("revert", tree)
    assert rv.exit_code == 2 and "--force" in one_error_line(rv)
    assert snapshot(tree) == edited
    rv = run("revert", "--force", tree)
    assert rv.exit_code == 0, rv.output
    kept = tree / (FI_MLA + ".kvpatch-drifted")
    assert "q_nope.dtype,  # FP8" in kept.read_text()
    kept.unlink()
    assert snapshot(tree) == original
    assert patched != original


def test_status_partly_patched_and_runtime_edit(tree):
    assert run("apply", tree).exit_code == 0
    original_fi = (EXAMPLE / FI_MLA).read_bytes()
    (tree / FI_MLA).write_bytes(original_fi)  # someone put the upstream file back
    st = run("status", tree)
    assert st.exit_code == 1 and st.stdout.startswith("partly patched")
    assert "back to the original bytes" in st.stdout
    assert run("apply", tree).exit_code == 0  # apply completes it
    assert run("status", tree).exit_code == 0
    rt = tree / RUNTIME
    rt.write_text(rt.read_text() + "\n# tweaked\n")
    st = run("status", tree)
    assert st.exit_code == 3 and "runtime module was edited" in st.stdout


# -- interrupted apply -----------------------------------------------------------------
def test_crash_at_every_write_point_then_recover(tmp_path):
    pristine = tmp_path / "pristine"
    shutil.copytree(EXAMPLE, pristine)
    n = n_writes(pristine)
    assert n == 6  # two original copies, two backends (FlashInfer MLA, FA3), runtime, state.json
    golden = tmp_path / "golden"
    shutil.copytree(pristine, golden)
    assert run("apply", golden).exit_code == 0
    patched = snapshot(golden)
    original = snapshot(pristine)
    for k in range(n + 2):
        root = tmp_path / f"crash{k}"
        shutil.copytree(pristine, root)
        r = kvpatch_subprocess("apply", root, env={"KVPATCH_TEST_CRASH_AFTER": str(k)})
        if k == n + 1:  # past the last replacement: the hook never fires
            assert r.returncode == 0, r.stderr
            assert snapshot(root) == {**patched, ".kvpatch/state.json": snapshot(root)[".kvpatch/state.json"]}
            continue
        assert r.returncode == 137, (k, r.stderr)
        st = run("status", "--json", root)
        doc = json.loads(st.stdout)
        assert st.exit_code == 4 and doc["state"] == "interrupted", (k, st.output)
        assert {pl["file"] for pl in doc["places"]} >= {FI_MLA, RUNTIME, ".kvpatch/state.json"}
        assert "kvpatch recover" in doc["detail"]
        rc = run("recover", root)
        assert rc.exit_code == 0 and "\nrolled back" in "\n" + rc.stdout, rc.output
        assert snapshot(root) == original, f"crash after {k} write(s): recover did not restore every byte"
        assert run("status", root).exit_code == 1  # not patched
        again = run("apply", root)
        assert again.exit_code == 0, again.output
        assert {k2: v for k2, v in snapshot(root).items() if k2 != ".kvpatch/state.json"} == \
            {k2: v for k2, v in patched.items() if k2 != ".kvpatch/state.json"}


def test_crash_in_git_checkout_leaves_no_branch_or_commit(example_git):
    head = git(example_git, "rev-parse", "HEAD")
    original = snapshot(example_git)
    n = n_writes(example_git)
    r = kvpatch_subprocess("apply", example_git, env={"KVPATCH_TEST_CRASH_AFTER": str(n)})
    assert r.returncode == 137
    assert run("status", example_git).exit_code == 4
    # apply never rolls back a journal on the side (a cloned fork may ship one):
    # it refuses, touching nothing, and names recover.
    interrupted = snapshot(example_git)
    r = run("apply", example_git)
    assert r.exit_code == 2 and "kvpatch recover" in r.output, r.output
    assert snapshot(example_git) == interrupted
    assert run("recover", example_git).exit_code == 0
    r = run("apply", example_git)
    assert r.exit_code == 0, r.output
    assert git(example_git, "rev-parse", "HEAD~1") == head
    rv = run("revert", example_git)
    assert rv.exit_code == 0
    assert git(example_git, "diff", head, "HEAD", "--stat") == ""
    assert {k: v for k, v in snapshot(example_git).items()} == original


def _wait_for_pause(proc, timeout=30.0) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stderr, selectors.EVENT_READ)
    buf = ""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if not sel.select(timeout=0.5):
            if proc.poll() is not None:
                break
            continue
        line = proc.stderr.readline()
        if not line:
            break
        buf += line
        if line.startswith("kvpatch-test: paused"):
            return buf
    proc.kill()
    raise AssertionError(f"apply never paused: {buf}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
@pytest.mark.parametrize("after", [1, 4], ids=["after-1", "after-all"])
def test_signal_inside_the_write_loop_rolls_back(tree, sig, after):
    original = snapshot(tree)
    env = {**os.environ, "KVPATCH_TEST_PAUSE_AFTER": str(after)}
    proc = subprocess.Popen([sys.executable, "-m", "kvpatch", "--color", "never", "apply", str(tree)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for_pause(proc)
        assert (tree / ".kvpatch/journal.json").exists()  # really inside the write
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "interrupted: every file was rolled back" in err and "Traceback" not in err
    assert snapshot(tree) == original
    assert run("status", tree).exit_code == 1


# -- bad inputs -----------------------------------------------------------------------
@pytest.mark.parametrize("cmd", COMMANDS)
def test_nonexistent_path(tmp_path, cmd):
    r = run(cmd, tmp_path / "nope")
    assert r.exit_code == 2
    assert "no such file or directory" in one_error_line(r) and r.stdout == ""


@pytest.mark.parametrize("cmd", COMMANDS)
def test_not_an_sglang_checkout(tmp_path, cmd):
    d = tmp_path / "photos"
    d.mkdir()
    (d / "a.txt").write_text("x")
    before = snapshot(d)
    r = run(cmd, d)
    assert r.exit_code == 2
    line = one_error_line(r)
    assert "expected an SGLang checkout" in line and "python/sglang/" in line
    assert snapshot(d) == before


def test_revert_and_recover_on_an_unpatched_tree(tree):
    before = snapshot(tree)
    rv = run("revert", tree)
    assert rv.exit_code == 2 and "was not patched" in one_error_line(rv)
    rc = run("recover", tree)
    assert rc.exit_code == 0 and rc.stdout.strip() == "nothing to recover"
    assert snapshot(tree) == before


BROKEN = "python/sglang/srt/layers/attention/broken_backend.py"


def test_syntax_error_reported_with_line_and_others_still_patched(tree):
    (tree / BROKEN).write_text("import torch\n\n\ndef f(:\n    return pool.get_key_buffer(0).to(q.dtype)\n")
    broken = (tree / BROKEN).read_bytes()
    a = run("audit", tree)
    assert a.exit_code == 2 and f"{BROKEN}:4: does not parse" in one_error_line(a)
    assert "FlashInferMLAAttnBackend.forward_decode" in a.stdout  # the other files were still audited
    ap = run("apply", tree)
    assert ap.exit_code == 5 and f"{BROKEN}:4" in one_error_line(ap)  # 5: patched, one file skipped
    assert "_kvpatch_rt.kv_for_mla_run(" in (tree / FI_MLA).read_text()  # ... and patched
    assert (tree / BROKEN).read_bytes() == broken


def test_non_utf8_file(tree):
    bad = tree / "python/sglang/srt/layers/attention/latin_backend.py"
    bad.write_bytes(b"def f(pool, q):\n    return pool.get_key_buffer(0).to(q.dtype)  # caf\xe9\n")
    data = bad.read_bytes()
    a = run("audit", tree)
    assert a.exit_code == 2
    line = one_error_line(a)
    assert "latin_backend.py" in line and "not decodable" in line
    ap = run("apply", tree)
    assert ap.exit_code == 5 and "latin_backend.py" in one_error_line(ap)
    assert bad.read_bytes() == data
    assert "_kvpatch_rt.kv_for_mla_run(" in (tree / FI_MLA).read_text()


def test_declared_latin1_file_is_read(tree):
    ok = tree / "python/sglang/srt/layers/attention/latin_backend.py"
    ok.write_bytes(b"# -*- coding: latin-1 -*-\n# caf\xe9\nclass LatinBackend:\n"
                   b"    def forward_decode(self, q, layer):\n"
                   b"        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n"
                   b"        return self.kernel(q, kv)\n")
    doc = json.loads(run("audit", "--json", tree).stdout)
    assert doc["errors"] == []
    assert any(s["qualname"] == "LatinBackend.forward_decode" and s["status"] == "hot" for s in doc["sites"])


def test_read_only_file_refused_with_nothing_written(tree):
    (tree / FI_MLA).chmod(0o444)
    before = snapshot(tree)
    r = run("apply", tree)
    assert r.exit_code == 2
    line = one_error_line(r)
    assert "read-only" in line and FI_MLA in line and "nothing was changed" in line
    assert snapshot(tree) == before


def test_symlinked_file_is_never_written_through(tree, tmp_path):
    outside = tmp_path / "outside" / "flashinfer_mla_backend.py"
    outside.parent.mkdir()
    shutil.move(tree / FI_MLA, outside)
    (tree / FI_MLA).symlink_to(outside)
    second = "python/sglang/srt/layers/attention/flashinfer_mla2_backend.py"
    shutil.copy(outside, tree / second)  # a real file next to it, still patched
    outside_bytes = outside.read_bytes()
    r = run("apply", tree)
    assert r.exit_code == 5  # the real file patched, the link skipped and named
    assert f"{FI_MLA}: is a symbolic link" in one_error_line(r)
    assert (tree / FI_MLA).is_symlink() and outside.read_bytes() == outside_bytes
    assert "_kvpatch_rt.kv_for_mla_run(" in (tree / second).read_text()
    rv = run("revert", tree)
    assert rv.exit_code == 0 and (tree / second).read_bytes() == outside_bytes


def test_symlinked_directories_never_loop_or_duplicate(tree):
    att = tree / "python/sglang/srt/layers/attention"
    (att / "loop").symlink_to("..", target_is_directory=True)  # attention/loop -> layers/
    (tree / "python/sglang/srt/alias").symlink_to("layers", target_is_directory=True)
    (tree / "python/sglang/self").symlink_to(".", target_is_directory=True)
    plain = json.loads(run("audit", "--json", EXAMPLE).stdout)
    doc = json.loads(run("audit", "--json", tree).stdout)
    assert doc["files_scanned"] == plain["files_scanned"]
    assert sorted((s["file"], s["line"]) for s in doc["sites"]) == sorted((s["file"], s["line"]) for s in plain["sites"])
    r = run("apply", tree)
    assert r.exit_code == 0, r.output
    snap = snapshot(tree)
    assert snap["python/sglang/srt/layers/attention/loop/"] == "link:.."
    assert snap["python/sglang/srt/alias/"] == "link:layers"
    links = ("python/sglang/srt/layers/attention/loop/", "python/sglang/srt/alias/", "python/sglang/self/")
    assert not any(k.startswith(link) and k != link for k in snap for link in links)  # nothing written inside


@pytest.mark.parametrize("cmd", ["audit", "apply"])
def test_unknown_rule_name(tree, cmd):
    before = snapshot(tree)
    r = run(cmd, "--rules", "NOPE", tree)
    assert r.exit_code == 2
    line = one_error_line(r)
    assert "unknown rule NOPE" in line and "KVP101" in line
    assert snapshot(tree) == before


def test_corrupt_state_record(tree):
    assert run("apply", tree).exit_code == 0
    (tree / ".kvpatch/state.json").write_text("{not json")
    for cmd in ("status", "revert"):
        r = run(cmd, tree)
        assert r.exit_code == 2, (cmd, r.output)
        assert "state" in one_error_line(r)


# -- formatting survives ------------------------------------------------------------------
CRLF_TABS = (
    "# -*- coding: utf-8 -*-\r\n"
    "from flashinfer import BatchMLAPagedAttentionWrapper\r\n"
    "\r\n"
    "\r\n"
    "class FlashInferMLAAttnBackend:\r\n"
    "\tdef __init__(self, model_runner):\r\n"
    "\t\tself.kv_indptr = model_runner.kv_indptr  # trailing\r\n"
    "\r\n"
    "\tdef forward_decode(self, q, q_rope, layer, forward_batch):\r\n"
    "\t\tdecode_wrapper = self.forward_metadata.decode_wrapper  # the wrapper\r\n"
    "\t\tk_buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(\r\n"  # line 11
    "\t\t\tq.dtype  # fp8 -> bf16\r\n"
    "\t\t)  # trailing comment after the cast\r\n"
    "\t\treturn decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])  # run\r\n"  # 14
    "\r\n"
    "\tdef forward_extend(self, q, q_rope, layer, forward_batch):\r\n"
    "\t\tw = self.forward_metadata.prefill_wrapper\r\n"
    "\t\tk = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # one line\r\n"  # 18
    "\t\treturn w.run(\r\n"
    "\t\t\tq,\r\n"
    "\t\t\tq_rope,\r\n"
    "\t\t\tk[:, :, :512],  # ckv\r\n"
    "\t\t\tk[:, :, 512:],  # kpe\r\n"
    "\t\t)\r\n"  # 24
)
BOM_NO_EOL = (
    "\ufefffrom flashinfer import BatchMLAPagedAttentionWrapper\n"
    "\n"
    "\n"
    "class FlashInferMLAAttnBackend:\n"
    "    def __init__(self, model_runner):\n"
    "        self.kv_indptr = model_runner.kv_indptr\n"
    "\n"
    "    def forward_decode(self, q, q_rope, layer, forward_batch):\n"
    "        decode_wrapper = self.forward_metadata.decode_wrapper\n"
    "        k_buffer = (  # why: the kernel wants bf16\n"  # line 10
    "            self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
    "            .to(q.dtype)  # the cast\n"
    "        )\n"
    "        return decode_wrapper.run(q, q_rope, k_buffer[..., :512], k_buffer[..., 512:])"  # 14, no newline
)
# original lines (1-based) that the rewrite may change: the casts, the run() calls
CHANGEABLE = {"crlf-tabs": {11, 12, 13, 14, 18, 19, 23, 24}, "bom-no-eol": {10, 11, 12, 13, 14}}


@pytest.mark.parametrize("name,source", [("crlf-tabs", CRLF_TABS), ("bom-no-eol", BOM_NO_EOL)])
def test_formatting_survives_apply_and_revert(tmp_path, name, source):
    import difflib

    root = tmp_path / "sglang"
    (root / "python/sglang").mkdir(parents=True)
    (root / "python/sglang/version.py").write_text('__version__ = "0"\n')
    fi = root / FI_MLA
    fi.parent.mkdir(parents=True)
    raw = source.encode("utf-8")
    fi.write_bytes(raw)
    r = run("apply", root)
    assert r.exit_code == 0, r.output
    new = fi.read_bytes()
    text = new.decode("utf-8-sig" if name == "bom-no-eol" else "utf-8")
    compile(text, FI_MLA, "exec")
    assert "_kvpatch_rt.kv_for_mla_run(" in text and "_kvpatch_rt.mla_run(" in text
    old_lines = raw.decode("utf-8").splitlines(True)
    new_lines = new.decode("utf-8").splitlines(True)
    if name == "crlf-tabs":
        assert all(ln.endswith("\r\n") for ln in new_lines), "a line lost its CRLF"
        assert not any(ln.startswith(" ") for ln in new_lines), "spaces in a tab-indented file"
        for comment in ("# trailing", "# the wrapper", "# fp8 -> bf16", "# trailing comment after the cast",
                        "# run", "# one line", "# ckv", "# kpe"):
            assert comment in text, comment
    else:
        assert new.startswith(b"\xef\xbb\xbf") and new.count(b"\xef\xbb\xbf") == 1
        assert not new.endswith(b"\n"), "the missing final newline must stay missing"
        assert "# why: the kernel wants bf16" in text and "# the cast" in text
    # byte-exact outside the rewritten spans: only insertions, or changes on the cast / run() lines
    sm = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False)
    for op, i1, i2, _, _ in sm.get_opcodes():
        if op in ("replace", "delete"):
            assert set(range(i1 + 1, i2 + 1)) <= CHANGEABLE[name], (op, old_lines[i1:i2])
    rv = run("revert", root)
    assert rv.exit_code == 0, rv.output
    assert fi.read_bytes() == raw
    assert not (root / ".kvpatch").exists() and not (root / RUNTIME).exists()


def test_multiline_receiver_keeps_its_indentation(tmp_path):
    root = tmp_path / "sglang"
    (root / "python/sglang").mkdir(parents=True)
    fi = root / FI_MLA
    fi.parent.mkdir(parents=True)
    fi.write_text(
        "from flashinfer import BatchMLAPagedAttentionWrapper\n\n\n"
        "class B:\n"
        "    def forward_decode(self, q, q_rope, layer, forward_batch):\n"
        "        w = self.forward_metadata.decode_wrapper\n"
        "        k = self.token_to_kv_pool.get_key_buffer(  # the pool\n"
        "            layer.layer_id\n"
        "        ).to(q.dtype)\n"
        "        return w.run(q, q_rope, k[:, :, :512], k[:, :, 512:])\n")
    assert run("apply", root).exit_code == 0
    text = fi.read_text()
    compile(text, FI_MLA, "exec")
    assert "\n                layer.layer_id\n            ),\n" in text, text
