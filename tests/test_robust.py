"""Issue 10 items 23 and 25: deep nesting and CR-only line endings."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from conftest import FI_MLA
from kvpatch.cli.commands import main
from kvpatch.output.exitcodes import EXIT_ERROR, EXIT_PARTIAL

import test_hardening as th


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def _tree(tmp_path, extra):
    root = tmp_path / "sglang"
    (root / "python/sglang").mkdir(parents=True)
    (root / "python/sglang/version.py").write_text('__version__ = "0"\n')
    fi = root / FI_MLA
    fi.parent.mkdir(parents=True)
    fi.write_text(th.CRLF_TABS.replace("\r\n", "\n"))
    deep = fi.parent / "deep_backend.py"
    deep.write_text(extra)
    return root, fi, deep


def _site_fn(body_expr):
    return (
        "class FlashInferMLAAttnBackend:\n"
        "    def forward_decode(self, q, layer):\n"
        "        k = self.token_to_kv_pool.get_key_buffer(layer.layer_id).to(q.dtype)\n"
        f"        x = {body_expr}\n"
        "        return k\n"
    )


DEEP = {
    "nested-calls": _site_fn("f(" * 150 + "1" + ")" * 150),
    "nested-lists": _site_fn("[" * 150 + "1" + "]" * 150),
    "operator-chain": _site_fn(" + ".join(["a"] * 400)),
    "module-100k": _site_fn("1") + "X = " + " + ".join(["1"] * 100_000) + "\n",
}


@pytest.mark.parametrize("name", sorted(DEEP))
@pytest.mark.parametrize("cmd", ["audit", "status", "apply"])
def test_deep_nesting_is_unparseable_and_others_go_on(tmp_path, name, cmd):
    root, fi, deep = _tree(tmp_path, DEEP[name])
    r = run(cmd, root)
    out = r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "Traceback" not in out and "maximum recursion depth" not in out, out
    if "does not parse" in out:
        assert "deep_backend.py" in out, out
        # apply wrote the other file: 5 (partial, the skipped one named); audit/status: 2
        assert r.exit_code == (EXIT_PARTIAL if cmd == "apply" else EXIT_ERROR), out
    else:
        # How deep a parser goes depends on the interpreter (3.10 parses the 100k
        # chain; 3.11+ refuse it). A file that parsed is analysed in full: the
        # same result as the same file without the deep expression.
        plain_root, _, _ = _tree(tmp_path / "plain", _site_fn("1"))
        plain = run(cmd, plain_root)
        assert r.exit_code == plain.exit_code, (out, plain.output)
        assert out.count("deep_backend.py") == plain.output.count("deep_backend.py"), (out, plain.output)
    if cmd == "apply":  # the other file is still patched
        assert "_kvpatch_rt.kv_for_mla_run(" in fi.read_text()
    elif cmd == "audit":  # the other file is still audited
        assert "flashinfer_mla_backend.py" in out


def test_cr_only_line_endings_kept(tmp_path):
    root, fi, deep = _tree(tmp_path, "X = 1\n")
    deep.unlink()
    fi.write_bytes(th.CRLF_TABS.replace("\r\n", "\r").encode())
    r = run("apply", root)
    assert r.exit_code == 0, r.output
    new = fi.read_bytes()
    assert b"_kvpatch_rt.kv_for_mla_run(" in new
    assert b"\n" not in new, "a rewritten line got LF endings in a CR-only file"
