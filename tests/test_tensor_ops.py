"""Tensor ops in both spellings: `x.split(...)` and `torch.split(x, ...)`.

A KV buffer keeps its kind (whole pool, or gathered rows) through views and
splits whatever the spelling, and only a gather along the row dimension makes
it gathered (issue 10 item 9: an aiter-style `torch.index_select` then
`torch.split`, cast under a guard, was never reported). The independent ast
oracle (tools/ast_oracle.py) must give the same verdict on every case, since the
real-checkout test compares the two.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap

import pytest
from click.testing import CliRunner

from conftest import REPO
from kvpatch.cli.commands import main
from kvpatch.engine import analyze_source
from kvpatch.rule import load_rules
from kvpatch.sites import GATHERED, HOT

REL = "python/sglang/srt/layers/attention/rowpick_backend.py"

# Written for this test, shaped like a prefill path that gathers the prefix rows
# with the torch function forms, splits latent and rope parts, and casts them
# only for an FP8 cache.
GATHER_THEN_SPLIT = """
import torch


class RowPickBackend:
    def forward_extend(self, q, k, v, layer, forward_batch):
        kv_indices = self.forward_metadata.kv_indices
        K_Buffer = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        V_Buffer = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        kv_lora_rank = V_Buffer.shape[-1]
        rope_dim = K_Buffer.shape[-1] - kv_lora_rank
        if layer.qk_head_dim != kv_lora_rank + rope_dim:
            K_Buffer = torch.index_select(K_Buffer, 0, kv_indices)
            kvc, k_pe = torch.split(K_Buffer, [kv_lora_rank, rope_dim], dim=-1)
            if self.kv_cache_dtype == self.fp8_dtype:
                dtype = q.dtype
                kvc = kvc.to(dtype)
                k_pe = k_pe.to(dtype)
            kv = layer.kv_b_proj(kvc.contiguous())[0]
            return self.prefill(q, kv, k_pe)
        return self.decode(q, K_Buffer)
"""


def _fn(body: str) -> str:
    return ("import torch\n\n\ndef forward(self, q, layer, idx, cols):\n"
            "    pool = self.token_to_kv_pool.get_key_buffer(layer.layer_id)\n"
            + textwrap.indent(textwrap.dedent(body).strip(), "    ") + "\n")


# (source, the status of every cast in it)
CASES = {
    "index_select-then-split": (GATHER_THEN_SPLIT, GATHERED),
    "split-function-of-whole-pool": (_fn("""
        latent, rope = torch.split(pool, [512, 64], dim=-1)
        return self.kernel(q, latent.to(q.dtype), rope.to(q.dtype))
        """), HOT),
    "narrow-function-of-whole-pool": (_fn("""
        return self.kernel(q, torch.narrow(pool, -1, 0, 512).to(q.dtype))
        """), HOT),
    "index_select-of-columns": (_fn("""
        return self.kernel(q, torch.index_select(pool, -1, cols).to(q.dtype))
        """), HOT),
    "index_select-of-columns-method": (_fn("""
        return self.kernel(q, pool.index_select(dim=2, index=cols).to(q.dtype))
        """), HOT),
    "piece-of-a-split-method": (_fn("""
        return self.kernel(q, pool.split([512, 64], dim=-1)[0].to(q.dtype))
        """), HOT),
    "chunk-function-then-gather": (_fn("""
        latent = torch.chunk(pool, 2, dim=-1)[0]
        return self.kernel(q, latent[idx].to(q.dtype))
        """), GATHERED),
    "local-import-alias": (_fn("""
        import torch as T
        rows = T.index_select(pool, 0, idx)
        latent, rope = T.split(rows, [512, 64], dim=-1)
        return self.kernel(q, latent.to(q.dtype), rope.to(q.dtype))
        """), GATHERED),
}


def n_casts(src: str) -> int:
    return src.count(".to(")


def _oracle():
    spec = importlib.util.spec_from_file_location("ast_oracle", REPO / "tools" / "ast_oracle.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ast_oracle"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", list(CASES))
def test_status_follows_the_data_whatever_the_spelling(name):
    src, status = CASES[name]
    fa = analyze_source(REL, src.encode(), load_rules())
    assert not fa.errors, fa.errors
    casts = [s for s in fa.sites if s.form in ("assignment", "inline", "two-statement")]
    assert [s.status for s in casts] == [status] * n_casts(src), [(s.line, s.status, s.reason) for s in casts]


# The oracle knows the function forms as `torch.<op>` only, not a local alias.
ORACLE_CASES = [n for n in CASES if n != "local-import-alias"]


@pytest.mark.parametrize("name", ORACLE_CASES)
def test_oracle_agrees(name):
    src, status = CASES[name]
    o = _oracle()
    hits = [h for h in o.scan_source(REL, src, o.POOL_GETTERS, o.TUPLE_GETTERS) if not h.device_only]
    kind = {GATHERED: "gathered", HOT: "pool"}[status]
    # "mixed": the oracle is flow-insensitive, so a name rebound from the pool to
    # its gathered rows is both; it must never give the opposite verdict.
    assert len(hits) == n_casts(src)
    assert {h.kind for h in hits} <= {kind, "mixed"}, [(h.line, h.kind) for h in hits]


def test_audit_shows_the_gathered_casts(example):
    """The command a user runs lists both casts, `gathered`, and exits as before
    (the example tree's own hot sites)."""
    (example / REL).write_text(GATHER_THEN_SPLIT)
    r = CliRunner().invoke(main, ["audit", "--json", str(example)])
    doc = json.loads(r.stdout)
    mine = [(s["statement"], s["status"]) for s in doc["sites"] if s["file"] == REL]
    assert mine == [("kvc = kvc.to(dtype)", GATHERED), ("k_pe = k_pe.to(dtype)", GATHERED)]
    assert r.exit_code == 1
