"""The upgrade audit: `kvpatch audit OLD NEW` and `kvpatch audit PATH --against REF`.

Fixture trees are small SGLang-shaped checkouts written here (never copies of
SGLang); each test edits the "new" one the way an upstream change would. The
`real_sglang` tests at the end replay the real history of the FlashInfer MLA
backend when KVPATCH_SGLANG_CHECKOUTS points at git checkouts.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional

import jsonschema
import pytest
from click.testing import CliRunner

from conftest import git, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.upgrade.inventory import _excerpt, normalize_statement
from kvpatch.upgrade.model import JSON_SCHEMA, SITE_CATEGORIES

FI = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
FA = "python/sglang/srt/layers/attention/flashattention_backend.py"
TORCH = "python/sglang/srt/layers/attention/torch_mla_backend.py"
DECODE = "FlashInferMLAAttnBackend.forward_decode"
EXTEND = "FlashInferMLAAttnBackend.forward_extend"

FI_SRC = '''\
"""FlashInfer MLA attention backend (kvpatch test fixture)."""

from __future__ import annotations

import torch
from flashinfer import BatchMLAPagedAttentionWrapper


class FlashInferMLAAttnBackend:
    def __init__(self, model_runner):
        self.kv_indptr = model_runner.kv_indptr
        self.data_type = model_runner.dtype

    def forward_extend(self, q, k, v, layer, forward_batch, q_rope=None):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper
        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:])

    def forward_decode(self, q, k, v, layer, forward_batch, q_rope=None):
        decode_wrapper = self.forward_metadata.decode_wrapper
        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return decode_wrapper.run(q, q_rope, k_buffer[:, :, :512], k_buffer[:, :, 512:])


class FlashInferMLAIndicesUpdaterDecode:
    def __init__(self, model_runner, attn_backend):
        self.data_type = model_runner.dtype
        self.attn_backend = attn_backend

    def call_begin_forward(self, wrapper, q_indptr, kv_indptr, kv_indices, kv_lens, sm_scale):
        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale,
                     self.data_type, self.data_type)
'''

TORCH_SRC = '''\
import torch


class TorchMLABackend:
    def forward_decode(self, q, layer, forward_batch):
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        rows = kv[forward_batch.kv_indices].to(q.dtype)
        return torch.matmul(q, rows.transpose(0, 1))
'''

FA_SRC = '''\
from sgl_kernel import flash_attn_with_kvcache


class FlashAttentionBackend:
    def forward_decode(self, q, k, v, layer, forward_batch):
        kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return flash_attn_with_kvcache(q=q, k_cache=kv_cache, page_table=self.forward_metadata.page_table)
'''


def write_tree(root: Path, files: Dict[str, str]) -> Path:
    (root / "python/sglang").mkdir(parents=True, exist_ok=True)
    (root / "python/sglang/version.py").write_text('__version__ = "0.9.0"\n')
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return root


def pair(tmp_path: Path, new_files: Optional[Dict[str, str]] = None, drop=(), old_files=None):
    old = write_tree(tmp_path / "old", old_files or {FI: FI_SRC, TORCH: TORCH_SRC})
    new = tmp_path / "new"
    shutil.copytree(old, new)
    for rel in drop:
        (new / rel).unlink()
    for rel, text in (new_files or {}).items():
        p = new / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return old, new


def run(*args, env=None):
    return CliRunner().invoke(main, list(map(str, args)), env=env or {})


def upgrade_json(*args) -> dict:
    r = run("audit", "--json", *args)
    assert r.exit_code in (0, 1, 2), r.output
    doc = json.loads(r.stdout)
    jsonschema.validate(doc, JSON_SCHEMA)
    assert doc["exit_code"] == r.exit_code, r.output
    return doc


def entries(doc, qualname: str, kind: str = "sites") -> List[dict]:
    return [e for e in doc[kind] if e["qualname"] == qualname]


def one(doc, qualname: str, kind: str = "sites") -> dict:
    got = entries(doc, qualname, kind)
    assert len(got) == 1, got
    return got[0]


# -- categories --------------------------------------------------------------------
def test_identical_trees_are_unchanged_and_clean(tmp_path):
    old, new = pair(tmp_path)
    doc = upgrade_json(old, new)
    assert doc["exit_code"] == 0 and doc["action_needed"] == []
    assert {e["category"] for e in doc["sites"] + doc["plan_calls"]} == {"unchanged"}
    assert doc["summary"]["sites"]["unchanged"] == 3 and doc["summary"]["plan_calls"]["unchanged"] == 1
    assert doc["patch"]["applies"] and doc["patch"]["sites_rewritten"] == 2 and doc["patch"]["plans_rewritten"] == 1
    [f] = doc["patch"]["files"]
    assert f["file"] == FI and f["lines_added"] > 0 and len(f["sites"]) == 2
    assert doc["patch"]["runtime_files"] == [{"file": FI.rsplit("/", 1)[0] + "/_kvpatch_runtime.py",
                                              "action": "create"}]


def test_moved_lines_keep_identity(tmp_path):
    shifted = FI_SRC.replace("class FlashInferMLAAttnBackend:\n",
                             "# a comment\n# another\n\nclass FlashInferMLAAttnBackend:\n")
    old, new = pair(tmp_path, {FI: shifted})
    doc = upgrade_json(old, new)
    d = one(doc, DECODE)
    assert d["category"] == "moved" and d["new"]["line"] == d["old"]["line"] + 3
    assert one(doc, "FlashInferMLAIndicesUpdaterDecode.call_begin_forward", "plan_calls")["category"] == "moved"
    assert one(doc, "TorchMLABackend.forward_decode")["category"] == "unchanged"
    assert doc["exit_code"] == 0


def test_reformatting_and_comments_are_not_a_change(tmp_path):
    reformatted = FI_SRC.replace(
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
        "# the FP8 pool, cast for the kernel\n"
        "        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(\n"
        "            layer.layer_id\n"
        "        ).to(q.dtype)  # fp8 -> bf16")
    old, new = pair(tmp_path, {FI: reformatted})
    d = one(upgrade_json(old, new), DECODE)
    assert d["category"] == "moved" and not d["statement_changed"]


def test_receiver_refactor_is_a_changed_shape_with_both_statements(tmp_path):
    refactored = FI_SRC.replace("forward_batch.token_to_kv_pool", "self.token_to_kv_pool")
    old, new = pair(tmp_path, {FI: refactored})
    doc = upgrade_json(old, new)
    for q in (DECODE, EXTEND):
        e = one(doc, q)
        assert e["category"] == "changed" and e["statement_changed"]
        assert e["old"]["statement"].startswith(("k_buf", "k_buffer")) and "forward_batch." in e["old"]["statement"]
        assert "self.token_to_kv_pool" in e["new"]["statement"]
        assert "buffer `forward_batch.token_to_kv_pool" in e["why"]
        assert not e["action"]  # still rewritten by apply
    assert doc["exit_code"] == 0
    human = run("audit", old, new)
    assert "- k_buffer = forward_batch.token_to_kv_pool" in human.output
    assert "+ k_buffer = self.token_to_kv_pool" in human.output


def test_new_hot_site_needs_action(tmp_path):
    old, new = pair(tmp_path, {FA: FA_SRC})
    doc = upgrade_json(old, new)
    e = one(doc, "FlashAttentionBackend.forward_decode")
    assert e["category"] == "new" and e["action"] and e["new_status"] == "hot" and e["old"] is None
    assert doc["exit_code"] == 1
    assert any("FlashAttentionBackend.forward_decode" in a for a in doc["action_needed"])
    # apply still applies; the FA3 site is left as is, with its reason
    assert doc["patch"]["applies"]
    assert [s["file"] for s in doc["patch"]["skipped"]] == [FA]


def test_new_gathered_site_is_no_action(tmp_path):
    more = TORCH_SRC + '''
    def forward_extend(self, q, layer, forward_batch):
        kv = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        return torch.matmul(q, kv[forward_batch.out_cache_loc].to(q.dtype).transpose(0, 1))
'''
    old, new = pair(tmp_path, {TORCH: more})
    doc = upgrade_json(old, new)
    e = one(doc, "TorchMLABackend.forward_extend")
    assert e["category"] == "new" and not e["action"] and e["new_status"] == "gathered"
    assert doc["exit_code"] == 0


def test_removed_function(tmp_path):
    gone = FI_SRC.replace('''    def forward_extend(self, q, k, v, layer, forward_batch, q_rope=None):
        prefill_wrapper_paged = self.forward_metadata.prefill_wrapper
        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:])

''', "")
    old, new = pair(tmp_path, {FI: gone}, drop=[TORCH])
    doc = upgrade_json(old, new)
    e = one(doc, EXTEND)
    assert e["category"] == "removed" and e["new"] is None and not e["action"]
    assert "is gone from" in e["why"]
    t = one(doc, "TorchMLABackend.forward_decode")
    assert t["category"] == "removed" and "the file is gone" in t["why"]
    assert one(doc, DECODE)["category"] == "moved"  # five lines up
    assert doc["exit_code"] == 0


def test_fixed_upstream_native_fp8(tmp_path):
    native = FI_SRC.replace(
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)")
    old, new = pair(tmp_path, {FI: native})
    doc = upgrade_json(old, new)
    e = one(doc, DECODE)
    assert e["category"] == "fixed-upstream", e
    assert e["old_status"] == "hot" and e["new_status"] == "fixed-upstream" and e["new"]["form"] == "direct"
    assert doc["exit_code"] == 0 and doc["patch"]["sites_rewritten"] == 1


def test_fixed_upstream_gathered_rows(tmp_path):
    gathered = FI_SRC.replace(
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)[forward_batch.kv_indices].to(q.dtype)")
    old, new = pair(tmp_path, {FI: gathered})
    e = one(upgrade_json(old, new), DECODE)
    assert e["category"] == "fixed-upstream" and e["old_status"] == "hot"
    assert e["new_status"] == "fixed-upstream" and "gathered" in e["why"]


def test_fixed_upstream_cast_gone_from_a_non_mla_backend(tmp_path):
    no_cast = FA_SRC.replace(".to(q.dtype)", "")
    old, new = pair(tmp_path, {FA: no_cast}, old_files={FI: FI_SRC, FA: FA_SRC})
    doc = upgrade_json(old, new)
    e = one(doc, "FlashAttentionBackend.forward_decode")
    assert e["category"] == "fixed-upstream" and e["new"] is None
    assert "casts nothing" in e["why"] and "still reads the KV buffer" in e["why"]
    assert doc["exit_code"] == 0


def test_unmatched_function_shows_its_source(tmp_path):
    renamed = FI_SRC.replace(
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
        "k_buffer = forward_batch.token_to_kv_pool.get_kv_cache_fp8(layer.layer_id).to(q.dtype)")
    old, new = pair(tmp_path, {FI: renamed})
    doc = upgrade_json(old, new)
    e = one(doc, DECODE)
    assert e["category"] == "unmatched" and e["action"]
    f = e["function"]
    assert f["qualname"] == DECODE and not f["truncated"] and not f["reads_kv_buffer"]
    assert "get_kv_cache_fp8(layer.layer_id).to(q.dtype)" in f["source"]
    assert f["casts"] and f["casts"][0]["code"].endswith(".to(q.dtype)")
    assert f["source"].lstrip().startswith("def forward_decode(")
    assert doc["exit_code"] == 1
    human = run("audit", old, new)
    assert human.exit_code == 1
    assert "| " + " " * 8 + "k_buffer = forward_batch.token_to_kv_pool.get_kv_cache_fp8" in human.output


def test_a_cast_of_q_left_in_the_function_is_not_unmatched(tmp_path):
    """Issue 10 item 6 (aiter forward_extend at ece8a1a78): upstream drops the
    pool cast and casts q to the pool's dtype instead. Only casts of KV data
    count; the site is fixed upstream and the audit exits 0."""
    fixed = FI_SRC.replace(
        "        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
        "        k_buf = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
        "        q = q.to(self.kv_cache_dtype)\n        o = q.float()\n").replace(
        "        return prefill_wrapper_paged.run(q, q_rope, k_buf[:, :, :512], k_buf[:, :, 512:])\n",
        "        return mla_prefill_fwd(q, k_buf, o)\n")
    assert fixed.count("mla_prefill_fwd") == 1
    old, new = pair(tmp_path, {FI: fixed})
    doc = upgrade_json(old, new)
    e = one(doc, EXTEND)
    assert e["category"] != "unmatched" and not e["action"], e


def test_unmatched_long_function_is_excerpted_around_the_casts(tmp_path):
    filler = "".join(f"        x{i} = q.shape[{i % 3}]\n" for i in range(60))
    long_fn = FI_SRC.replace(
        "        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n",
        filler + "        k_buffer = forward_batch.token_to_kv_pool.fetch(layer.layer_id).to(q.dtype)\n" + filler)
    old, new = pair(tmp_path, {FI: long_fn})
    f = one(upgrade_json(old, new), DECODE)["function"]
    assert f["truncated"] and f["end_line"] - f["line"] > 100
    assert "fetch(layer.layer_id).to(q.dtype)" in f["source"] and "... (" in f["source"]
    assert len(f["source"].splitlines()) < 40


def test_excerpt_keeps_short_functions_whole():
    lines = [f"l{i}\n" for i in range(1, 31)]
    text, cut = _excerpt(lines, 1, 30, [5])
    assert not cut and text.count("\n") == 30
    text, cut = _excerpt(lines * 3, 1, 90, [50])
    assert cut and "l20" in text and "l1\n" in text and "l80" not in text


def test_file_moved_keeps_identity(tmp_path):
    dst = "python/sglang/srt/layers/attention/flashinfer/mla_backend.py"
    old, new = pair(tmp_path, {dst: FI_SRC}, drop=[FI])
    doc = upgrade_json(old, new)
    e = one(doc, DECODE)
    assert e["category"] == "moved" and e["file"] == dst and e["old"]["file"] == FI
    assert "file moved from" in e["why"]
    assert one(doc, "FlashInferMLAIndicesUpdaterDecode.call_begin_forward", "plan_calls")["category"] == "moved"
    assert doc["exit_code"] == 0


def test_renamed_function_with_the_same_statement_is_moved(tmp_path):
    renamed = TORCH_SRC.replace("def forward_decode(", "def forward_decode_absorbed(")
    old, new = pair(tmp_path, {TORCH: renamed})
    e = one(upgrade_json(old, new), "TorchMLABackend.forward_decode_absorbed")
    assert e["category"] == "moved" and "renamed from TorchMLABackend.forward_decode" in e["why"]


def test_function_moved_to_another_file_is_followed(tmp_path):
    """The NSA -> DSA move of 2025-11: the function went to another file and lost its cast."""
    body = "".join(f"        step{i} = self.helper{i}(q, layer)\n" for i in range(8))
    old_src = ("class NsaBackend:\n    def forward_extend(self, q, layer, forward_batch):\n" + body +
               "        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
               "        kv = kv.to(q.dtype)\n        return self.kernel(q, kv, page_table=forward_batch.pt)\n")
    new_src = old_src.replace("NsaBackend", "DsaBackend").replace("        kv = kv.to(q.dtype)\n", "")
    old_rel = "python/sglang/srt/layers/attention/nsa_backend.py"
    new_rel = "python/sglang/srt/layers/attention/dsa_backend.py"
    old, new = pair(tmp_path, {new_rel: new_src, old_rel: "from .dsa_backend import *  # noqa\n"},
                    old_files={FI: FI_SRC, old_rel: old_src})
    e = one(upgrade_json(old, new), "NsaBackend.forward_extend")
    assert e["category"] == "fixed-upstream", e
    assert "DsaBackend.forward_extend" in e["why"] and "casts nothing" in e["why"]


def test_rule_or_status_change_is_reported(tmp_path):
    # The cast now also reaches a call that is not run(): no rule can rewrite it.
    late = FI_SRC.replace('''        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
''', '''        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        self.debug_dump(k_buffer)
''')
    old, new = pair(tmp_path, {FI: late})
    doc = upgrade_json(old, new)
    e = one(doc, DECODE)
    assert e["old_status"] == "hot" and e["new_status"] == "unsupported"
    assert e["action"] and "apply no longer rewrites it" in " ".join(doc["action_needed"])
    assert doc["exit_code"] == 1


def test_plan_call_changed_form(tmp_path):
    keyword = FI_SRC.replace(
        '''        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale,
                     self.data_type, self.data_type)''',
        '''        wrapper.plan(
            qo_indptr=q_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_lens,
            num_heads=16, head_dim_ckv=512, head_dim_kpe=64, page_size=self.page_size, causal=False,
            sm_scale=sm_scale, q_data_type=self.data_type, kv_data_type=self.data_type,
        )''')
    old, new = pair(tmp_path, {FI: keyword})
    doc = upgrade_json(old, new)
    p = one(doc, "FlashInferMLAIndicesUpdaterDecode.call_begin_forward", "plan_calls")
    assert p["category"] == "changed" and "form positional -> keyword" in p["why"]
    assert p["new"]["page_size"] == "self.page_size" and p["old"]["page_size"] == "1"
    assert doc["exit_code"] == 0 and doc["patch"]["plans_rewritten"] == 1


def test_plan_call_no_longer_recognised_is_unmatched(tmp_path):
    short = FI_SRC.replace(
        '''        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale,
                     self.data_type, self.data_type)''',
        "        wrapper.plan(q_indptr, kv_indptr, kv_indices, *self.plan_args)")
    old, new = pair(tmp_path, {FI: short})
    doc = upgrade_json(old, new)
    p = one(doc, "FlashInferMLAIndicesUpdaterDecode.call_begin_forward", "plan_calls")
    assert p["category"] == "unmatched" and p["action"] and p["function"]["source"].count(".plan(") == 1
    assert doc["exit_code"] == 1


def test_refused_rewrite_needs_action(tmp_path):
    old, new = pair(tmp_path)
    real = new / "elsewhere.py"
    (new / FI).rename(real)
    (new / FI).symlink_to(real)
    doc = upgrade_json(old, new)
    assert not doc["patch"]["applies"]
    assert doc["patch"]["refused"][0]["file"] == FI and "symbolic link" in doc["patch"]["refused"][0]["message"]
    assert doc["exit_code"] == 1 and any("apply would refuse" in a for a in doc["action_needed"])


def test_syntax_error_in_the_new_tree_is_an_error(tmp_path):
    old, new = pair(tmp_path, {"python/sglang/srt/layers/attention/broken_backend.py":
                               "def f(:\n    return pool.get_key_buffer(0).to(q.dtype)\n"})
    r = run("audit", "--json", old, new)
    assert r.exit_code == 2
    doc = json.loads(r.stdout)
    assert doc["errors"] == [{"tree": "new", "file": "python/sglang/srt/layers/attention/broken_backend.py",
                              "message": doc["errors"][0]["message"], "line": 1}]
    assert one(doc, DECODE)["category"] == "unchanged"  # the rest was still compared


def test_sarif_has_results_for_new_changed_unmatched(tmp_path):
    edited = FI_SRC.replace(
        "k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)",
        "k_buffer = forward_batch.token_to_kv_pool.get_kv_cache_fp8(layer.layer_id).to(q.dtype)"
    ).replace("k_buf = forward_batch.token_to_kv_pool", "k_buf = self.token_to_kv_pool")
    old, new = pair(tmp_path, {FI: edited, FA: FA_SRC})
    out = tmp_path / "up.sarif"
    r = run("audit", "--sarif", "-o", out, old, new)
    assert r.exit_code == 1
    doc = json.loads(out.read_text())
    assert doc["version"] == "2.1.0" and doc["runs"][0]["tool"]["driver"]["name"] == "kvpatch"
    res = doc["runs"][0]["results"]
    by_rule = {x["ruleId"]: x for x in res}
    assert set(by_rule) == {"KVU001", "KVU002", "KVU003"}
    assert by_rule["KVU001"]["level"] == "error"  # a new hot site
    assert by_rule["KVU002"]["level"] == "note"  # changed, still rewritten
    assert by_rule["KVU003"]["level"] == "error"
    for x in res:
        loc = x["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"]["uriBaseId"] == "SRCROOT" and loc["region"]["startLine"] >= 1
        rules = doc["runs"][0]["tool"]["driver"]["rules"]
        assert rules[x["ruleIndex"]]["id"] == x["ruleId"]


def test_human_output_sections(tmp_path):
    old, new = pair(tmp_path, {FA: FA_SRC})
    r = run("--color", "never", "audit", old, new)
    assert r.exit_code == 1
    out = r.output
    for text in ("kvpatch upgrade audit:", "sites: 1 new, 3 unchanged", "plan calls: 1 unchanged",
                 "apply on the new tree: applies", "action needed (1)", "kvpatch audit (upgrade):"):
        assert text in out, text
    verbose = run("--color", "never", "-v", "audit", old, new)
    assert verbose.output.count("unchanged      ") == 4  # 3 sites, 1 plan call listed one by one


def test_output_file_and_nothing_written_to_the_trees(tmp_path):
    old, new = pair(tmp_path, {FA: FA_SRC})
    before = tree_hashes(old), tree_hashes(new)
    out = tmp_path / "report.txt"
    r = run("audit", "-o", out, old, new)
    assert r.exit_code == 1 and "action needed" in out.read_text()
    assert "\x1b[" not in out.read_text()
    assert (tree_hashes(old), tree_hashes(new)) == before


@pytest.mark.parametrize("case", ["missing", "not-sglang", "both", "file"])
def test_bad_upgrade_arguments_are_one_line_errors(tmp_path, case):
    old, new = pair(tmp_path)
    args = {"missing": [old, tmp_path / "nope"],
            "not-sglang": [old, tmp_path / "empty"],
            "both": [old, new, "--against", "HEAD"],
            "file": [old, new / FI]}[case]
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "notes.txt").write_text("x")
    r = run("audit", *args)
    assert r.exit_code == 2, r.output
    assert r.output.startswith("error: ") and r.output.count("\n") == 1, r.output
    expect = {"missing": "no such file", "not-sglang": "expected an SGLang checkout", "both": "not both",
              "file": "not a directory"}[case]
    assert expect in r.output


# -- --against REF ---------------------------------------------------------------------
def _repo(tmp_path: Path) -> Path:
    root = write_tree(tmp_path / "repo", {FI: FI_SRC, TORCH: TORCH_SRC, "README.md": "fixture\n"})
    git(root, "init", "-q", "-b", "main")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "old")
    return root


def test_against_ref_compares_the_working_tree(tmp_path, monkeypatch):
    root = _repo(tmp_path)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)
    (root / FI).write_text(FI_SRC.replace("forward_batch.token_to_kv_pool", "self.token_to_kv_pool"))
    (root / FA).write_text(FA_SRC)
    doc = upgrade_json(root, "--against", "HEAD")
    assert doc["old"]["ref"] == "HEAD" and len(doc["old"]["commit"]) == 40
    assert one(doc, DECODE)["category"] == "changed"
    assert one(doc, "FlashAttentionBackend.forward_decode")["category"] == "new"
    assert doc["exit_code"] == 1
    assert list(tmp.iterdir()) == []  # the materialized REF is gone
    status = git(root, "status", "--porcelain", "--untracked-files=all").splitlines()
    assert sorted(ln.split()[-1] for ln in status) == sorted([FI, FA])  # the working tree is as it was
    assert git(root, "worktree", "list").count("\n") == 0  # no worktree left behind


def test_against_ref_with_a_subdirectory_and_an_older_commit(tmp_path):
    root = _repo(tmp_path)
    (root / FA).write_text(FA_SRC)
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "fa3")
    doc = upgrade_json(root / "python", "--against", "HEAD~1")
    e = one(doc, "FlashAttentionBackend.forward_decode")
    assert e["category"] == "new" and e["file"] == "sglang/srt/layers/attention/flashattention_backend.py"
    assert one(doc, DECODE)["category"] == "unchanged"
    clean = upgrade_json(root, "--against", "HEAD")
    assert clean["exit_code"] == 0 and {e["category"] for e in clean["sites"]} == {"unchanged"}


def test_against_reads_unwritten_ref_files_from_git(tmp_path):
    """Only the files the audit reads are written out from REF; the others are still
    known (their count, their functions), read from git on demand."""
    root = _repo(tmp_path)
    helper = "python/sglang/srt/layers/attention/helpers.py"
    (root / helper).write_text("def forward_decode_tail(self, q, layer):\n    return q\n")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "add", "-A")
    git(root, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "helper")
    # upstream moves the TorchMLA cast into the (old, marker-free) helper function
    (root / TORCH).write_text(TORCH_SRC.replace("def forward_decode(", "def forward_decode_old("))
    (root / TORCH).write_text("import torch\n")
    (root / helper).write_text(
        "def forward_decode_tail(self, q, layer, forward_batch):\n"
        "    kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
        "    rows = kv[forward_batch.kv_indices].to(q.dtype)\n"
        "    return rows\n")
    doc = upgrade_json(root, "--against", "HEAD")
    assert doc["old"]["files_scanned"] == doc["new"]["files_scanned"] == 4  # version, FI, torch, helpers
    assert doc["old"]["candidate_files"] == 2  # only FI and torch were written out
    e = one(doc, "forward_decode_tail")
    assert e["category"] == "new", e  # its function existed at REF: not the old site moved here
    assert one(doc, "TorchMLABackend.forward_decode")["category"] == "removed"


@pytest.mark.parametrize("case", ["bad-ref", "not-git", "path-not-in-ref"])
def test_against_errors(tmp_path, case):
    if case == "not-git":
        target, ref = write_tree(tmp_path / "plain", {FI: FI_SRC}), "HEAD"
        expect = "not inside a git repository"
    elif case == "bad-ref":
        target, ref = _repo(tmp_path), "no-such-branch"
        expect = "not a commit"
    else:
        root = _repo(tmp_path)
        (root / "python/sglang/newpkg").mkdir()
        (root / "python/sglang/newpkg/mod.py").write_text("x = 1\n")
        target, ref = root / "python/sglang/newpkg", "HEAD"
        expect = "no Python files there"
    r = run("audit", target, "--against", ref)
    assert r.exit_code == 2, r.output
    assert expect in r.output and r.output.count("\n") == 1, r.output


def test_normalize_statement_ignores_layout_and_comments():
    a = "k = pool.get_key_buffer(layer.layer_id).to(q.dtype)"
    b = "# note\nk = pool.get_key_buffer(\n    layer.layer_id\n).to(q.dtype)  # cast"
    assert normalize_statement(a) == normalize_statement(b)
    assert normalize_statement(a) != normalize_statement(a.replace("q.dtype", "q_nope.dtype"))
    assert normalize_statement("if x:\n    y = 1\n") != ""
    assert normalize_statement("not python (") == "not python ("


def test_categories_are_documented():
    import kvpatch.upgrade as up

    for c in SITE_CATEGORIES:
        assert c in up.__doc__
    assert "kvpatch.upgrade/1" in up.__doc__


# -- real SGLang history ---------------------------------------------------------------
ENV = "KVPATCH_SGLANG_CHECKOUTS"
REAL_FI = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
# new sha -> (old ref, expected exit code, {qualname: categories of its FlashInfer MLA site entries})
REAL_PAIRS = {
    # the FP8 cast arrives: new hot sites, where the old tree handed the pool over uncast
    "2e4babdb0": ("2e4babdb0^", 1, {EXTEND: {"new", "replaced"}, DECODE: {"new", "replaced"}}),
    "3cc3d9b95": ("2e4babdb0", 1, {EXTEND: {"moved"}, DECODE: {"changed"}}),  # page size > 1
    "ebd9dbe71": ("3cc3d9b95", 0, {EXTEND: {"moved"}, DECODE: {"changed"}}),  # the revert
    "c5251a98a": ("eae59b337", 1, {EXTEND: {"changed"}, DECODE: {"changed"}}),  # forward_batch. -> self.
    "ea8f4e9f3": ("c5251a98a", 0, {EXTEND: {"unchanged"}, DECODE: {"unchanged"}}),  # DCP
    "4ad990ba7": ("ea8f4e9f3", 0, {EXTEND: {"moved"}, DECODE: {"moved"}}),
}


def _real_checkouts() -> Dict[str, Path]:
    """sha prefix -> checkout, for the checkouts KVPATCH_SGLANG_CHECKOUTS lists."""
    found: Dict[str, Path] = {}
    for entry in [e for e in os.environ.get(ENV, "").split(os.pathsep) if e.strip()]:
        p = Path(entry).expanduser()
        cands = [p] if (p / ".git").exists() else sorted(c for c in p.glob("*") if (c / ".git").exists())
        for c in cands:
            if not (c / "python/sglang").is_dir():
                continue
            head = subprocess.run(["git", "-C", str(c), "rev-parse", "HEAD"], capture_output=True,
                                  text=True).stdout.strip()
            for sha in REAL_PAIRS:
                if head.startswith(sha):
                    found.setdefault(sha, c)
    return found


REAL = _real_checkouts()
SKIP_REAL = (f"set {ENV}=/path/to/checkouts (git checkouts of SGLang at "
             f"{', '.join(REAL_PAIRS)}, or a directory holding them) to replay the real upgrade pairs")


@pytest.mark.real_sglang
@pytest.mark.parametrize("new_sha", list(REAL_PAIRS))
def test_real_upgrade_pair(new_sha):
    if new_sha not in REAL:
        pytest.skip(SKIP_REAL if not os.environ.get(ENV) else f"no checkout at {new_sha} in {ENV}")
    root = REAL[new_sha]
    old_ref, rc, expect = REAL_PAIRS[new_sha]
    status_before = git(root, "status", "--porcelain")
    doc = upgrade_json(root, "--against", old_ref)
    assert doc["errors"] == [] and doc["exit_code"] == rc, doc["action_needed"]
    for qualname, cats in expect.items():
        got = {e["category"] for e in doc["sites"] if e["file"] == REAL_FI and e["qualname"] == qualname}
        assert got == cats, (qualname, got)
    # The two FlashInfer MLA sites and their three plan calls; since the page-table family
    # (KVP103) the FA3 backend's sites are rewritten too, and counted in the total.
    fi = [f for f in doc["patch"]["files"] if f["file"] == REAL_FI]
    assert doc["patch"]["applies"] and len(fi) == 1 and len(fi[0]["sites"]) == 2
    assert doc["patch"]["sites_rewritten"] == sum(len(f["sites"]) for f in doc["patch"]["files"])
    assert doc["patch"]["plans_rewritten"] == 3 == len(fi[0]["plan_calls"])
    assert git(root, "status", "--porcelain") == status_before  # only read


@pytest.mark.real_sglang
def test_real_against_itself_is_unchanged():
    if not REAL:
        pytest.skip(SKIP_REAL)
    root = REAL[sorted(REAL)[-1]]
    doc = upgrade_json(root, "--against", "HEAD")
    assert {e["category"] for e in doc["sites"] + doc["plan_calls"]} == {"unchanged"}
    assert doc["exit_code"] == 0


def test_changed_plan_call_shows_the_argument_that_changed(tmp_path):
    """A long plan call whose 12th argument changed: the -/+ lines show that argument,
    not the first 150 characters of the call, which are the same on both sides."""
    plan = '''        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, self.num_local_heads, self.kv_lora_rank,
                     self.qk_rope_head_dim, self.page_size, False, sm_scale, self.q_data_type, {})'''
    old_src = FI_SRC.replace('''        wrapper.plan(q_indptr, kv_indptr, kv_indices, kv_lens, 16, 512, 64, 1, False, sm_scale,
                     self.data_type, self.data_type)''', plan.format("self.data_type"))
    assert old_src != FI_SRC
    old, new = pair(tmp_path, {FI: old_src.replace("self.q_data_type, self.data_type)",
                                                   "self.q_data_type, self.kv_cache_dtype)")},
                    old_files={FI: old_src, TORCH: TORCH_SRC})
    r = run("--color", "never", "audit", old, new)
    lines = [ln.strip() for ln in r.output.splitlines()]
    assert "- wrapper.plan(..., self.data_type)" in lines, r.output
    assert "+ wrapper.plan(..., self.kv_cache_dtype)" in lines, r.output


def test_changed_pair_keeps_short_statements_whole_and_cuts_long_ones_to_whole_arguments():
    from kvpatch.upgrade.render import changed_pair
    assert changed_pair("x = f(a)", "x = f(b)") == ("x = f(a)", "x = f(b)")
    args = ", ".join(f"argument_{i}" for i in range(20))
    old = f"out = kernel({args}, flag=True)"
    new = old.replace("argument_13,", "argument_13[:n],")
    assert changed_pair(old, new) == ("out = kernel(..., argument_13, ...)", "out = kernel(..., argument_13[:n], ...)")
    nested = old.replace("argument_5,", "f(g(argument_5), h),")
    assert changed_pair(old, nested) == ("out = kernel(..., argument_5, ...)", "out = kernel(..., f(g(argument_5), h), ...)")


# -- the config's exclude ---------------------------------------------------------------
def test_old_new_honours_the_configs_exclude_in_both_trees(tmp_path):
    """As plain audit: [tool.kvpatch] exclude (found from OLD) leaves the file out of
    both trees, so its new hot site is neither listed nor an action."""
    old, new = pair(tmp_path, {FA: FA_SRC})
    assert one(upgrade_json(old, new), "FlashAttentionBackend.forward_decode")["category"] == "new"
    (old / "pyproject.toml").write_text(f"[tool.kvpatch]\nexclude = ['{FA}']\n")
    doc = upgrade_json(old, new)
    assert not [e for e in doc["sites"] + doc["plan_calls"] if e["file"] == FA], doc["sites"]
    assert doc["exit_code"] == 0 and not doc["action_needed"] and doc["patch"]["skipped"] == []
    assert one(doc, DECODE)["category"] == "unchanged"  # the rest is compared as before


def test_against_ref_honours_the_configs_exclude(tmp_path):
    root = _repo(tmp_path)
    (root / FA).write_text(FA_SRC)
    assert one(upgrade_json(root, "--against", "HEAD"), "FlashAttentionBackend.forward_decode")["category"] == "new"
    (root / "pyproject.toml").write_text("[tool.kvpatch]\nexclude = ['python/**/flashattention_*.py']\n")
    doc = upgrade_json(root, "--against", "HEAD")
    assert not [e for e in doc["sites"] if e["file"] == FA] and doc["exit_code"] == 0, doc["sites"]
    assert one(doc, DECODE)["category"] == "unchanged"


def test_vv_of_the_upgrade_audit_gives_each_trees_files_and_the_phase_times(tmp_path):
    old, new = pair(tmp_path, {FA: FA_SRC})
    v, vv = run("-v", "audit", old, new), run("-vv", "audit", old, new)
    assert v.exit_code == vv.exit_code == 1
    assert "unchanged      " in v.stdout and vv.stdout == v.stdout  # -v: the unchanged entries listed
    debug = [ln for ln in vv.output.splitlines() if ln.startswith("debug: ")]
    assert not [ln for ln in v.output.splitlines() if ln.startswith("debug: ")]
    assert f"debug: scan of {old.resolve()}: 3 file(s) scanned, 2 candidate(s)" in debug, debug
    assert f"debug:   {FA}: 1 site(s), 0 plan call(s)" in debug  # only the new tree has FA3
    times = [ln for ln in debug if ln.startswith("debug: time: ")]
    assert len(times) == 1 and times[0].startswith("debug: time: old-tree scan ") \
        and ", new-tree scan " in times[0] and ", plan+rewrite+compare " in times[0], times
