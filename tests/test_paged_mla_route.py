"""KVP108 (rules/paged_mla_route.py) beyond its own examples: what it refuses (KVP103 then
decides, as before), that flash_mla_prefill stays KVP103's, that `--rules` without it hands
its sites to KVP103, that status/drift/revert know its patched form, and that the real
SGLang releases' XPU decode site (0.5.16 to 0.5.23's xpu_backend.py) gets it.

No torch needed: these read and rewrite source."""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from conftest import REPO, tree_hashes
from kvpatch.cli.commands import main
from kvpatch.engine import analyze_source, scan_tree
from kvpatch.rule import load_rules
from kvpatch.rules._page_table_examples import XPU_DECODE, XPU_PREFILL
from kvpatch.ruletest import REL
from kvpatch.sites import HOT, PATCHED
from test_releases import RELEASES_ENV, _release_root

RULES = load_rules()
XPU_FIXTURE = REPO / "tests" / "data" / "xpu"
XPU_REL = "python/sglang/srt/layers/attention/xpu_backend.py"
XPU_IN_PACKAGE = "sglang/srt/layers/attention/xpu_backend.py"
LOCAL_RELEASES = Path("/work/cache/releases")
ROUTED_CALL = "_kvpatch_rt.paged_mla("


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def cast_sites(code: str, rules=RULES):
    fa = analyze_source(REL, textwrap.dedent(code).encode(), rules)
    assert not fa.errors, fa.errors
    return [s for s in fa.sites if ".to(" in s.statement or s.status == PATCHED]


def _decode(call_args: str, extra: str = "") -> str:
    """XPU_DECODE with the call's arguments (after `flash_mla_decode(`) replaced."""
    body = XPU_DECODE[:XPU_DECODE.index("flash_mla_decode(")] + f"flash_mla_decode({call_args})\n"
    return body.replace("        return", extra + "        return") if extra else body


ARGS = ("q, q_rope, {cache}, metadata.cache_seqlens_int32, metadata.page_table, self.workspace, layer.scaling")
VIEW = "kv_cache.view(-1, self.page_size, layer.head_dim)"

# Sites KVP108 cannot prove routable: None from it, and KVP103 decides (rewrites or reports).
REFUSED = {
    "starred": _decode(ARGS.format(cache=VIEW).replace(", layer.scaling", ", *rest")),
    "more positions than parameters": _decode(ARGS.format(cache=VIEW) + ", 1, 2"),
    "unknown keyword": _decode(ARGS.format(cache=VIEW) + ", block_size=64"),
    "a parameter twice": _decode(ARGS.format(cache=VIEW) + ", seq_lens=metadata.lens"),
    "a required parameter missing": _decode("q, q_rope, " + VIEW + ", metadata.cache_seqlens_int32, "
                                            "metadata.page_table"),
    "another reader": _decode(ARGS.format(cache=VIEW), "        self.debug_dump(kv_cache)\n"),
    "the cast as the query": _decode(ARGS.format(cache=VIEW).replace("q, q_rope", "kv_cache, q_rope")),
    "a slice of the rows": _decode(ARGS.format(cache="kv_cache[:, :, :576].view(-1, self.page_size, 576)")),
    "two names on the way": _decode(ARGS.format(cache="pages"),
                                    "        pages = kv_cache.view(-1, self.page_size, layer.head_dim)\n"),
    "a call in a lambda": _decode(ARGS.format(cache=VIEW)).replace("return flash_mla_decode(",
                                                                    "return lambda: flash_mla_decode("),
    "a closure reads the cast": _decode(
        ARGS.format(cache=VIEW),
        "        def dump():\n            return kv_cache.sum()\n\n        self.hook(dump)\n"),
    "a kernel from a call": _decode(ARGS.format(cache=VIEW)).replace("flash_mla_decode(", "get()(", 1),
}


@pytest.mark.parametrize("why", list(REFUSED))
def test_what_kvp108_cannot_prove_is_left_to_kvp103(why):
    sites = cast_sites(REFUSED[why])
    assert sites and all(s.rule != "KVP108" for s in sites), [(s.rule, s.status, s.reason) for s in sites]


def test_the_sites_it_takes_and_those_it_leaves():
    (routed,) = cast_sites(XPU_DECODE)
    assert (routed.rule, routed.status, routed.fixable) == ("KVP108", HOT, True)
    # flash_mla_prefill: ragged, causal queries, not the fused path's contract: KVP103's page cast.
    (prefill,) = cast_sites(XPU_PREFILL)
    assert (prefill.rule, prefill.status, prefill.fixable) == ("KVP103", HOT, True)


def test_rules_without_kvp108_hand_its_site_to_kvp103(tmp_path):
    root = tmp_path / "x"
    shutil.copytree(XPU_FIXTURE, root)
    assert run("apply", "--rules", "KVP103", root).exit_code == 0
    text = (root / XPU_REL).read_text()
    assert text.count("_kvpatch_rt.kv_pages_for_kernel(") == 2 and ROUTED_CALL not in text


def audit_sites(root: Path):
    r = run("audit", "--json", root)
    assert r.exit_code in (0, 1), r.output
    return {(s["qualname"], s["rule"], s["status"]) for s in json.loads(r.stdout[:r.stdout.rindex("}") + 1])["sites"]}


def test_status_drift_and_revert_know_the_routed_form(tmp_path):
    root = tmp_path / "x"
    shutil.copytree(XPU_FIXTURE, root)
    before = tree_hashes(root)
    assert ("XPUAttentionBackend.forward_decode", "KVP108", HOT) in audit_sites(root)
    assert run("apply", root).exit_code == 0
    f = root / XPU_REL
    assert f"o = {ROUTED_CALL}\n            flash_mla_decode,\n            q_nope,\n" in f.read_text()
    assert audit_sites(root) == {("XPUAttentionBackend.forward_extend", "KVP106", PATCHED),
                                 ("XPUAttentionBackend.forward_decode", "KVP108", PATCHED)}
    st = run("status", root)
    assert st.exit_code == 0 and st.output.startswith("patched"), st.output
    again = tree_hashes(root)
    assert run("apply", root).exit_code == 0 and tree_hashes(root) == again  # idempotent
    # An edit to the routed call is drift: status names it, revert refuses without --force.
    patched = f.read_text()
    f.write_text(patched.replace("            flash_mla_decode,\n", "            flash_mla_decode,  # mine\n"))
    st = run("status", root)
    assert st.exit_code == 3 and "XPUAttentionBackend.forward_decode" in st.output and ROUTED_CALL in st.output
    assert run("revert", root).exit_code == 2
    f.write_text(patched)
    assert run("revert", root).exit_code == 0
    assert tree_hashes(root) == before


# --- the real releases -------------------------------------------------------------------------


@pytest.mark.real_sglang
@pytest.mark.parametrize("version", ["0.5.16", "0.5.20", "0.5.23"])
def test_release_xpu_decode_is_routed(tmp_path_factory, tmp_path, monkeypatch, version):
    """The XPU backend's absorbed-MLA decode (`flash_mla_decode(q_nope, q_rope,
    kv_cache.view(-1, self.page_size, layer.head_dim), ...)`) gets KVP108; extend's
    `flash_mla_prefill` (0.5.20+) stays KVP103's page-gathered cast."""
    if not os.environ.get(RELEASES_ENV) and LOCAL_RELEASES.is_dir():
        monkeypatch.setenv(RELEASES_ENV, str(LOCAL_RELEASES))
    src = _release_root(version, tmp_path_factory.mktemp(f"whl-{version}")) / XPU_IN_PACKAGE
    root = tmp_path / "rel"
    (root / XPU_IN_PACKAGE).parent.mkdir(parents=True)
    shutil.copyfile(src, root / XPU_IN_PACKAGE)
    before = tree_hashes(root)
    original = src.read_text()
    sites = [s for s in scan_tree(root).sites if s.qualname == "XPUAttentionBackend.forward_decode"
             and ".to(q.dtype)" in s.statement]
    assert [(s.rule, s.status, s.fixable) for s in sites] == [("KVP108", HOT, True)], \
        [(s.line, s.rule, s.status, s.reason) for s in sites]
    assert run("apply", root).exit_code in (0, 1)
    text = (root / XPU_IN_PACKAGE).read_text()
    compile(text, XPU_IN_PACKAGE, "exec")
    assert text.count(ROUTED_CALL) == original.count("flash_mla_decode(") == 1
    assert f"o = {ROUTED_CALL}\n                flash_mla_decode,\n                q_nope,\n" in text
    if "flash_mla_prefill(" in original:
        assert "o = flash_mla_prefill(" in text  # not routed: KVP103 casts its pages
        ext = [s for s in scan_tree(root).sites if s.qualname == "XPUAttentionBackend.forward_extend"
               and s.kernel == "`flash_mla_prefill`"]
        assert [(s.rule, s.status) for s in ext] == [("KVP103", PATCHED)], ext
    after = {s.rule for s in scan_tree(root).sites if s.qualname == "XPUAttentionBackend.forward_decode"
             and s.status == PATCHED}
    assert "KVP108" in after
    assert run("revert", root).exit_code == 0
    assert tree_hashes(root) == before
