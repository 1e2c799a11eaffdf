"""Issue 7: a cast whose result is never read as data still casts the whole pool.
Audit reports it hot and says it is a dead store, never "no consumer" and never
an escaping result."""

from __future__ import annotations

import textwrap

import pytest

from kvpatch.engine import analyze_source
from kvpatch.rule import load_rules
from kvpatch.sites import HOT

REL = "python/sglang/srt/layers/attention/foo_backend.py"
HEAD = '''
class FooBackend:
    def forward_decode(self, q, layer, forward_batch):
'''
CAST = "self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)"
CASES = {
    "overwritten": (f"kv = {CAST}\nkv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
                    "return kern(q, kv, forward_batch.kv_indices)", "`kv` is overwritten at line 5 before any read"),
    "overwritten-after-view": (f"kv = {CAST}.view(-1, 1, 576)\nif q is None:\n    return None\n"
                               "kv = forward_batch.other\nreturn kern(q, kv)", "`kv` is overwritten at line 7"),
    "never-read": (f"kv = {CAST}\nreturn kern(q, forward_batch.kv_indices)", "`kv` is never read"),
    "discarded": (f"{CAST}\nreturn kern(q, forward_batch.kv_indices)", "its result is discarded"),
    "metadata-only": (f"kv = {CAST}\nreturn kern(q, kv.shape[0])", "read only for metadata"),
}


def _site(body: str):
    code = HEAD + textwrap.indent(body, " " * 8) + "\n"
    fa = analyze_source(REL, code.encode(), load_rules())
    assert not fa.errors, fa.errors
    (site,) = fa.sites
    return site


@pytest.mark.parametrize("name", sorted(CASES))
def test_dead_cast_is_hot_and_named_a_dead_store(name):
    """Issue 20: an unread dead cast is deleted by KVP104; one read for metadata stays report-only."""
    body, detail = CASES[name]
    site = _site(body)
    assert site.status == HOT and site.fixable == (name != "metadata-only")
    assert site.rule == ("KVP201" if name == "metadata-only" else "KVP104")
    assert "dead store" in site.reason and detail in site.reason, site.reason
    assert "no consumer" not in site.reason


DEAD_FILE = '''import torch


class FooBackend:
    def forward_decode(self, q, layer, forward_batch):
        # cast for the old kernel
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # FP8 -> BF16
        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        return kern(q, kv, forward_batch.kv_indices)

    def forward_extend(self, q, layer, forward_batch):
        if q is not None:
            self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        return kern(q, forward_batch.kv_indices)
'''


def test_apply_deletes_dead_casts_shows_them_in_the_diff_and_revert_restores_the_bytes(tmp_path):
    from click.testing import CliRunner

    from kvpatch.cli.commands import main

    path = tmp_path / REL
    path.parent.mkdir(parents=True)
    path.write_text(DEAD_FILE)
    run = lambda *a: CliRunner().invoke(main, [*a, str(tmp_path)])  # noqa: E731
    dry = run("apply", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "-        kv = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)  # FP8 -> BF16" \
        in dry.output and "+        # FP8 -> BF16" in dry.output, dry.output
    assert "+            pass" in dry.output
    assert path.read_text() == DEAD_FILE  # a dry run writes nothing
    done = run("apply")
    assert done.exit_code == 0, done.output
    new = path.read_text()
    compile(new, REL, "exec")
    assert ".to(q.dtype)" not in new and "# cast for the old kernel" in new and "# FP8 -> BF16" in new
    assert "nothing to do" in run("apply").output  # idempotent
    st = run("status")
    assert st.exit_code == 0 and "drift" not in st.output.lower(), st.output
    rv = run("revert")
    assert rv.exit_code == 0, rv.output
    assert path.read_bytes() == DEAD_FILE.encode()


@pytest.mark.parametrize("body", [
    f"kv = {CAST}\nif q is None:\n    kv = forward_batch.other\nreturn kern(q, kv)",  # read on the other path
    f"k, v = {CAST}.split([512, 64], dim=-1)\nreturn kern(q, k, v)",  # unpacked: not proven dead
])
def test_a_cast_read_on_some_path_is_not_dead(body):
    assert "dead store" not in _site(body).reason


def test_a_cast_reaching_helper_methods_names_them_and_what_a_rewrite_needs():
    """NSA's shape: the cast goes to this class's own helpers (one with page_table=), and to
    a function with no index structure; the reason names each and what a rewrite needs."""
    site = _site(f"kv = {CAST}\nif q is None:\n    return self._forward_fa3(q, kv, page_table=forward_batch.pt)\n"
                 "return dequantize_k_cache_paged(kv)")
    assert site.status == HOT and not site.fixable
    assert "`self._forward_fa3` is a method of this class" in site.reason, site.reason
    assert "`dequantize_k_cache_paged` takes the whole cast pool" in site.reason, site.reason
    assert "no rule rewrites this consumer" not in site.reason


FI_MLA = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
DISABLED_DECODE = '''
class FlashInferMLAAttnBackend:
    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None):
{raise_line}        decode_wrapper = self.forward_metadata.decode_wrapper
        q_nope = q.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_buffer = forward_batch.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)
        o = q_nope.new_empty(q_nope.shape)
        o = decode_wrapper.run(q_nope, q_rope, k_buffer[:, :, : layer.v_head_dim], k_buffer[:, :, layer.v_head_dim :],
                               out=o)
        return o
'''


def test_an_unreachable_cast_is_a_no_op_not_a_dead_store():
    """A fork that disables a forward with a `raise` on top (seen in fzyzcjy/sglang): the cast
    below never runs, so it costs nothing, and its result is read by the kernel call: it is
    neither hot nor a dead store. Without the raise, the same site is hot and names the kernel."""
    from kvpatch.sites import NOOP

    rules = load_rules()
    off = analyze_source(FI_MLA, DISABLED_DECODE.format(
        raise_line='        raise NotImplementedError("disabled in this fork")\n').encode(), rules)
    (site,) = off.sites
    assert site.status == NOOP and not site.fixable, site.reason
    assert site.reason.startswith("unreachable") and "dead store" not in site.reason
    on = analyze_source(FI_MLA, DISABLED_DECODE.format(raise_line="").encode(), rules)
    (site,) = on.sites
    assert site.status == HOT and "dead store" not in site.reason
    assert "decode_wrapper.run" in site.kernel


@pytest.mark.parametrize("body", [
    f"if q is None:\n    return None\nkv = {CAST}\nreturn kern(q, kv, forward_batch.kv_indices)",  # one path leaves
    f"for i in range(2):\n    if i:\n        continue\n    kv = {CAST}\n    kern(q, kv, forward_batch.kv_indices)",
    f"try:\n    raise ValueError\nexcept ValueError:\n    kv = {CAST}\nreturn kern(q, kv, forward_batch.kv_indices)",
])
def test_a_cast_that_some_path_reaches_is_not_unreachable(body):
    assert not _site(body).reason.startswith("unreachable")


def test_a_cast_after_continue_in_a_loop_is_unreachable():
    site = _site(f"for i in range(2):\n    continue\n    kv = {CAST}\n    kern(q, kv, forward_batch.kv_indices)\n"
                 "return None")
    assert site.reason.startswith("unreachable"), site.reason
