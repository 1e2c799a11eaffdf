"""Inline suppression: `# kvpatch: ignore[KVP101]` and bare `# kvpatch: ignore`,
as a user of `# noqa` / `# nosemgrep` would write them."""

from __future__ import annotations

import json

from click.testing import CliRunner

from conftest import FI_MLA
from kvpatch.cli.commands import main

FA3 = "python/sglang/srt/layers/attention/flashattention_backend.py"
FA3_CAST = "kv_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"
PREFILL_CAST = "k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def _edit(root, rel, old, new):
    p = root / rel
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


def _sites(root, rel=None):
    r = run("audit", "--json", root / rel if rel else root)
    return r.exit_code, json.loads(r.stdout)["sites"]


def test_comment_on_the_site_line_suppresses_it(example):
    assert _sites(example, FA3)[0] == 1  # hot without the comment
    _edit(example, FA3, FA3_CAST, FA3_CAST + "  # kvpatch: ignore[KVP106]")
    code, sites = _sites(example, FA3)
    (s,) = sites
    assert s["status"] == "suppressed" and s["suppressed_line"] == 23 and s["fixable"] is False
    assert "line 23" in s["reason"] and "was hot" in s["reason"]
    assert code == 0  # a suppressed site needs no action
    table = run("audit", example).output
    assert "suppressed" in table and "1 suppressed" in table


def test_bare_comment_suppresses_every_rule_and_another_rule_none(example):
    _edit(example, FA3, FA3_CAST, FA3_CAST + "  # kvpatch: ignore[KVP101]")
    assert _sites(example, FA3)[1][0]["status"] == "hot"  # names another rule: no effect
    _edit(example, FA3, "# kvpatch: ignore[KVP101]", "# kvpatch: ignore")
    assert _sites(example, FA3)[1][0]["status"] == "suppressed"


def test_comment_on_the_statement_line_then_apply_skips_it_and_status_is_patched(example):
    # The cast on a continuation line, the comment on the statement's first line.
    _edit(example, FI_MLA, PREFILL_CAST, "k_buf = (  # kvpatch: ignore[KVP107]\n"
          "                self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n            )")
    code, sites = _sites(example)
    by = {s["qualname"]: s for s in sites}
    pre = by["FlashInferMLAAttnBackend.forward_extend"]
    assert pre["status"] == "suppressed" and pre["suppressed_line"] == pre["line"] - 1
    assert by["FlashInferMLAAttnBackend.forward_decode"]["status"] == "hot"
    assert run("apply", "--no-commit", example).exit_code == 0
    text = (example / FI_MLA).read_text()
    assert "get_key_buffer(layer.layer_id).to(q.dtype)\n            )" in text  # left as is
    assert "_kvpatch_rt.kv_for_mla_run(" in text  # the decode site was rewritten
    st = run("status", example)
    assert st.output.startswith("patched"), st.output  # the suppressed site is not "missing"
    _, after = _sites(example)
    assert {s["qualname"]: s["status"] for s in after}["FlashInferMLAAttnBackend.forward_extend"] == "suppressed"


def test_sarif_carries_an_in_source_suppression(example):
    _edit(example, FA3, FA3_CAST, FA3_CAST + "  # kvpatch: ignore[KVP106]")
    doc = json.loads(run("audit", "--sarif", example).stdout)
    res = [r for r in doc["runs"][0]["results"] if r["properties"]["status"] == "suppressed"]
    assert len(res) == 1
    (sup,) = res[0]["suppressions"]
    assert sup["kind"] == "inSource"
    assert sup["location"]["physicalLocation"]["region"]["startLine"] == 23
    others = [r for r in doc["runs"][0]["results"] if r["properties"]["status"] != "suppressed"]
    assert others and all("suppressions" not in r for r in others)
