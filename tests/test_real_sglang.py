"""kvpatch on real SGLang checkouts: audit, an independent oracle, apply, revert.

Every test here is marked ``real_sglang`` and runs once per checkout listed in
``KVPATCH_SGLANG_CHECKOUTS`` (os.pathsep-separated; each entry a git checkout
of SGLang, or a directory whose sub-directories are such checkouts). Without
the variable every test skips, with the reason.

    KVPATCH_SGLANG_CHECKOUTS=/tmp/wt python -m pytest -m real_sglang tests/test_real_sglang.py

The given checkouts are only read: `apply` and `revert` run on a
``git clone --shared`` of each one (its HEAD, detached) in tmp_path, so no
branch, commit or file lands in the checkout or in its repository.

Run as a script, the same checks print one markdown row per checkout (the
table in notes/real-checkouts.md):

    python tests/test_real_sglang.py CHECKOUT [CHECKOUT ...]
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import pytest

REPO = Path(__file__).resolve().parents[1]
ENV = "KVPATCH_SGLANG_CHECKOUTS"
FI_MLA = "python/sglang/srt/layers/attention/flashinfer_mla_backend.py"
RUNTIME = FI_MLA.rsplit("/", 1)[0] + "/_kvpatch_runtime.py"
CAST_FORMS = {"assignment", "inline", "two-statement"}
AUDIT_SECONDS_LIMIT = 120.0  # a whole checkout; measured 0.4 s - 5 s on 700 - 5400 files
SKIP_REASON = (f"set {ENV}=/path/to/sglang[{os.pathsep}...] (git checkouts, or a directory containing them) "
               f"to run against real SGLang checkouts")


# -- which checkouts -----------------------------------------------------------
def _is_checkout(p: Path) -> bool:
    return (p / ".git").exists() and (p / "python" / "sglang").is_dir()


def checkouts_from_env() -> List[str]:
    raw = os.environ.get(ENV, "")
    out: List[str] = []
    for entry in [e for e in raw.split(os.pathsep) if e.strip()]:
        p = Path(entry).expanduser()
        if p.is_dir() and not _is_checkout(p):
            subs = sorted(c for c in p.iterdir() if c.is_dir() and _is_checkout(c))
            out += [str(c) for c in subs] or [str(p)]  # an empty dir fails its tests, loudly
        else:
            out.append(str(p))
    return out


CHECKOUTS = checkouts_from_env()
PARAMS = [pytest.param(c, id=Path(c).name) for c in CHECKOUTS] or [
    pytest.param(None, id="no-checkouts", marks=pytest.mark.skip(reason=SKIP_REASON))]
real = pytest.mark.real_sglang


# -- helpers -------------------------------------------------------------------
def kvpatch(*args, timeout: float = 600) -> subprocess.CompletedProcess:
    """The real command line, in a fresh process (worker processes and all)."""
    env = dict(os.environ, NO_COLOR="1")
    return subprocess.run([sys.executable, "-m", "kvpatch", "--color", "never", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=timeout)


def git(root: Path, *args: str, check: bool = True) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=check, capture_output=True,
                          text=True).stdout.strip()


def tree_hashes(root: Path) -> Dict[str, str]:
    """sha256 of every file under root (links by their target text), .git excluded."""
    out = {}
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != ".git"]
        for f in files:
            p = Path(d, f)
            rel = p.relative_to(root).as_posix()
            data = os.readlink(p).encode() if p.is_symlink() else p.read_bytes()
            out[rel] = hashlib.sha256(data).hexdigest()
    return out


@functools.lru_cache(maxsize=None)
def oracle():
    spec = importlib.util.spec_from_file_location("ast_oracle", REPO / "tools" / "ast_oracle.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ast_oracle"] = mod
    spec.loader.exec_module(mod)
    return mod


def oracle_hits(root: Path):
    o = oracle()
    _, hits, errors = o.scan_tree(str(root), o.POOL_GETTERS, o.TUPLE_GETTERS)
    return hits, errors


def mla_plan_calls(path: Path) -> List[int]:
    """Lines of the FlashInfer MLA plan() calls in a file, counted with `ast`
    (12 arguments: the MLA wrapper's plan; the internal `_cached_module.plan` has 9)."""
    import ast

    tree = ast.parse(path.read_text(encoding="utf-8"))
    return sorted(n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "plan"
                  and len(n.args) + len(n.keywords) >= 12)


def clone(src: Path, dst: Path) -> str:
    """A throw-away clone of src's HEAD (objects shared read-only), detached."""
    sha = git(src, "rev-parse", "HEAD")
    subprocess.run(["git", "clone", "-q", "--shared", "--no-checkout", str(src), str(dst)], check=True,
                   capture_output=True)
    git(dst, "checkout", "-q", "--detach", sha)
    git(dst, "config", "user.name", "kvpatch-test")
    git(dst, "config", "user.email", "kvpatch-test@example.invalid")
    return sha


@functools.lru_cache(maxsize=None)
def audit(root: str) -> dict:
    """`kvpatch audit --json` (and the table, timed) of a checkout, cached per run."""
    t0 = time.perf_counter()
    table = kvpatch("audit", root)
    table_s = time.perf_counter() - t0
    j = kvpatch("-q", "audit", "--json", root)
    doc = json.loads(j.stdout)
    doc["_table"], doc["_table_rc"], doc["_table_seconds"] = table.stdout, table.returncode, table_s
    doc["_table_stderr"], doc["_json_rc"] = table.stderr, j.returncode
    return doc


def fi_sites(doc: dict) -> List[dict]:
    return [s for s in doc["sites"] if s["file"] == FI_MLA and s["form"] in CAST_FORMS]


def fi_plans(doc: dict) -> List[dict]:
    return [p for p in doc["plan_calls"] if p["file"] == FI_MLA]


def fi_pool_casts(root: Path) -> list:
    """The oracle's whole-pool casts in the FlashInfer MLA backend."""
    p = root / FI_MLA
    if not p.exists():
        return []
    o = oracle()
    return [h for h in o.scan_source(FI_MLA, p.read_text(encoding="utf-8"), o.POOL_GETTERS, o.TUPLE_GETTERS)
            if h.kind == "pool" and not h.device_only]


# -- the apply cycle, as facts ---------------------------------------------------
COUNTS = re.compile(r"files changed: (\d+); sites (?:would be )?rewritten: (\d+); plan calls retargeted: (\d+); "
                    r"runtime files: (\d+)")


@dataclass
class Cycle:
    sha: str = ""
    dry_rc: int = -1
    dry_counts: tuple = ()
    dry_wrote: bool = True
    dry_diff: str = ""
    apply_rc: int = -1
    apply_out: str = ""
    counts: tuple = ()
    branch: str = ""
    head_branch: str = ""
    parent_is_original: bool = False
    commit_subject: str = ""
    clean_after_apply: bool = False
    changed: List[str] = field(default_factory=list)
    compile_errors: List[str] = field(default_factory=list)
    fi_text: str = ""
    audit_after: Optional[dict] = None
    oracle_after: Optional[dict] = None
    again_rc: int = -1
    again_out: str = ""
    again_same_head: bool = False
    again_same_tree: bool = False
    again_clean: bool = False
    status_rc: int = -1
    status_out: str = ""
    revert_rc: int = -1
    revert_out: str = ""
    revert_exact: bool = False
    revert_diff: List[str] = field(default_factory=list)
    revert_tree_same_as_original: bool = False
    status_after_revert: str = ""


def apply_cycle(src: Path, work: Path) -> Cycle:
    """dry-run, apply, compile, second apply, status, revert on a clone of src."""
    c = Cycle()
    root = work / "sglang"
    c.sha = clone(src, root)
    before = tree_hashes(root)

    dry = kvpatch("apply", "--dry-run", root)
    c.dry_rc, c.dry_diff = dry.returncode, dry.stdout
    m = COUNTS.search(dry.stdout)
    c.dry_counts = tuple(map(int, m.groups())) if m else ()
    c.dry_wrote = tree_hashes(root) != before or git(root, "status", "--porcelain") != ""

    ap = kvpatch("apply", root)
    c.apply_rc, c.apply_out = ap.returncode, ap.stdout + ap.stderr
    m = COUNTS.search(ap.stdout)
    c.counts = tuple(map(int, m.groups())) if m else ()
    m = re.search(r"branch (\S+), commit ([0-9a-f]+)", ap.stdout)
    c.branch = m.group(1) if m else ""
    c.head_branch = git(root, "rev-parse", "--abbrev-ref", "HEAD")
    c.parent_is_original = git(root, "rev-parse", "HEAD^", check=False) == c.sha
    c.commit_subject = git(root, "log", "-1", "--format=%s")
    c.clean_after_apply = git(root, "status", "--porcelain") == ""
    c.changed = [p for p in git(root, "diff", "--name-only", c.sha, "HEAD").splitlines() if p]
    cdir = Path(tempfile.mkdtemp(dir=work))
    for i, rel in enumerate(p for p in c.changed if p.endswith(".py")):
        try:  # the .pyc goes outside the tree: nothing may be left behind
            py_compile.compile(str(root / rel), cfile=str(cdir / f"{i}.pyc"), doraise=True)
        except py_compile.PyCompileError as exc:
            c.compile_errors.append(f"{rel}: {exc.msg}")
    if (root / FI_MLA).exists():
        c.fi_text = (root / FI_MLA).read_text(encoding="utf-8")
    j = kvpatch("-q", "audit", "--json", root)
    c.audit_after = json.loads(j.stdout)
    o = oracle()
    hits, _ = oracle_hits(root)
    c.oracle_after = o.compare(hits, c.audit_after)
    patched_tree = tree_hashes(root)
    head = git(root, "rev-parse", "HEAD")

    again = kvpatch("apply", root)
    c.again_rc, c.again_out = again.returncode, again.stdout + again.stderr
    c.again_same_head = git(root, "rev-parse", "HEAD") == head
    c.again_clean = git(root, "status", "--porcelain") == ""
    c.again_same_tree = tree_hashes(root) == patched_tree

    st = kvpatch("status", root)
    c.status_rc, c.status_out = st.returncode, st.stdout

    rv = kvpatch("revert", root)
    c.revert_rc, c.revert_out = rv.returncode, rv.stdout + rv.stderr
    after = tree_hashes(root)
    c.revert_exact = after == before
    c.revert_diff = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    c.revert_tree_same_as_original = subprocess.run(
        ["git", "-C", str(root), "diff", "--quiet", c.sha, "HEAD"]).returncode == 0
    c.status_after_revert = (kvpatch("status", root).stdout.splitlines() or [""])[0]
    shutil.rmtree(work, ignore_errors=True)  # a clone is ~100 MB; the facts are all we keep
    return c


_CYCLES: Dict[str, Cycle] = {}


def cycle_for(checkout: str, base: Path) -> Cycle:
    """The apply cycle of one checkout, run once per session (several tests read it)."""
    if checkout not in _CYCLES:
        work = base / f"{len(_CYCLES)}-{Path(checkout).name}"
        work.mkdir(parents=True)
        _CYCLES[checkout] = apply_cycle(Path(checkout), work)
    return _CYCLES[checkout]


@pytest.fixture(scope="session")
def workbase(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-sglang")


# -- fixtures --------------------------------------------------------------------
@pytest.fixture(params=PARAMS)
def checkout(request) -> Path:
    p = Path(request.param)
    if not _is_checkout(p):
        pytest.fail(f"{ENV} entry {p} is not a git checkout of SGLang (no .git or python/sglang/)")
    head, status = git(p, "rev-parse", "HEAD"), git(p, "status", "--porcelain")
    yield p
    # The given checkout is only ever read.
    assert git(p, "rev-parse", "HEAD") == head, f"{p}: HEAD moved"
    assert git(p, "status", "--porcelain") == status, f"{p}: the working tree changed"


# -- tests -----------------------------------------------------------------------
@real
def test_audit_runs_clean_and_fast(checkout):
    import jsonschema

    from kvpatch.output.report import JSON_SCHEMA

    doc = audit(str(checkout))
    jsonschema.validate({k: v for k, v in doc.items() if not k.startswith("_")}, JSON_SCHEMA)
    assert doc["errors"] == [], doc["errors"]
    assert doc["_json_rc"] == doc["exit_code"] == doc["_table_rc"] in (0, 1)
    hot = [s for s in doc["sites"] if s["status"] in ("hot", "unsupported")]
    assert doc["exit_code"] == (1 if hot else 0)
    assert doc["files_scanned"] > 100
    assert doc["seconds"] < AUDIT_SECONDS_LIMIT and doc["_table_seconds"] < AUDIT_SECONDS_LIMIT
    # The table shows every site and plan call the JSON has, under its file.
    table = doc["_table"]
    for s in doc["sites"] + doc["plan_calls"]:
        assert s["file"] in table and re.search(rf"^\s+{s['line']}\s+\S", table, re.M), s
    summary = doc["_table_stderr"].strip().splitlines()[-1]
    assert f"{doc['files_scanned']} files scanned" in summary
    for status, n in doc["summary"].items():
        if n:
            assert f"{n} {status}" in summary, (status, n, summary)


@real
def test_audit_agrees_with_oracle(checkout):
    """Every cast of a KV buffer the independent ast oracle finds is a kvpatch site,
    and every kvpatch cast site is one the oracle finds."""
    doc = audit(str(checkout))
    hits, _ = oracle_hits(checkout)
    res = oracle().compare(hits, doc)
    assert not res["only_oracle"], "kvpatch misses casts:\n" + "\n".join(
        f"  {h['file']}:{h['line']} {h['receiver']}.{h['method']}({h['args']})" for h in res["only_oracle"])
    assert not res["only_kvpatch"], "kvpatch reports casts the oracle does not see:\n" + "\n".join(
        f"  {s['file']}:{s['line']} {s['statement']}" for s in res["only_kvpatch"])
    # Same verdict on gathered vs whole-pool.
    for mt in res["matched"]:
        if mt["oracle_kind"] == "gathered":
            assert mt["status"] in ("gathered", "fixed-upstream"), mt
        elif mt["oracle_kind"] == "pool":
            assert mt["status"] in ("hot", "unsupported", "no-op"), mt


@real
def test_audit_finds_the_flashinfer_mla_sites(checkout):
    if not (checkout / FI_MLA).exists():
        pytest.skip(f"no {FI_MLA} in this checkout")
    doc = audit(str(checkout))
    casts = fi_pool_casts(checkout)
    sites = fi_sites(doc)
    plans = fi_plans(doc)
    assert sorted(p["line"] for p in plans) == mla_plan_calls(checkout / FI_MLA)
    if not casts:  # before 2e4babdb0: the FP8 pool went to the kernel as it is
        assert not [s for s in sites if s["status"] in ("hot", "unsupported")], sites
        return
    assert sorted(s["line"] for s in sites) == sorted(h.line for h in casts)
    assert {(s["qualname"].rsplit(".", 1)[-1], s["path"]) for s in sites} == {
        ("forward_extend", "prefill"), ("forward_decode", "decode")}
    for s in sites:
        assert (s["status"], s["rule"], s["fixable"]) == ("hot", "KVP101", True), s
        assert s["kernel"].endswith(".run"), s
    for p in plans:
        assert (p["status"], p["rule"], p["fixable"]) == ("rewrite", "KVP102", True), p
    assert {p["causal"] for p in plans} == {"False", "True"}


@real
def test_apply_dry_run_writes_nothing_and_matches_audit(checkout, workbase):
    c = cycle_for(str(checkout), workbase)
    doc = audit(str(checkout))
    assert c.dry_rc == 0, c.dry_diff
    assert not c.dry_wrote
    n_sites = len([s for s in doc["sites"] if s["fixable"]])
    n_plans = len([p for p in doc["plan_calls"] if p["fixable"]])
    assert c.dry_counts[1:3] == (n_sites, n_plans), c.dry_counts
    if c.dry_counts == (0, 0, 0, 0):
        assert "nothing to do" in c.apply_out, c.apply_out
    else:
        assert c.dry_counts == c.counts  # the dry run said exactly what apply did


@real
def test_apply_rewrites_compiles_and_commits(checkout, workbase):
    c = cycle_for(str(checkout), workbase)
    assert c.apply_rc == 0, c.apply_out
    if not c.counts or c.counts[0] == 0:
        assert "nothing to do" in c.apply_out
        return
    assert c.branch.startswith("kvpatch/") and c.head_branch == c.branch, (c.branch, c.head_branch)
    assert c.parent_is_original
    assert c.commit_subject.startswith("kvpatch: page-gathered FP8 KV cast")
    assert c.clean_after_apply
    assert not c.compile_errors, c.compile_errors
    assert not c.oracle_after["only_oracle"] and not c.oracle_after["only_kvpatch"], c.oracle_after
    if not (checkout / FI_MLA).exists():
        return
    assert FI_MLA in c.changed and RUNTIME in c.changed, c.changed
    n_casts = len(fi_pool_casts(checkout))
    n_plans = len(mla_plan_calls(checkout / FI_MLA))
    assert c.fi_text.count("_kvpatch_rt.kv_for_mla_run(") == n_casts
    assert c.fi_text.count("**_kvpatch_rt.run_kwargs(") == n_casts
    assert c.fi_text.count("_kvpatch_rt.plan_kv_dtype(") == n_plans
    assert c.fi_text.count("from . import _kvpatch_runtime as _kvpatch_rt") == 1
    # After apply: the FlashInfer sites read `patched`, the oracle sees no pool cast there.
    after = c.audit_after
    assert [s["status"] for s in after["sites"] if s["file"] == FI_MLA and s["form"] in CAST_FORMS
            and s["status"] != "gathered"] == []
    assert len([s for s in after["sites"] if s["file"] == FI_MLA and s["status"] == "patched"]) == n_casts
    assert {p["status"] for p in fi_plans(after)} <= {"patched"}


@real
def test_second_apply_changes_nothing_and_status_is_patched(checkout, workbase):
    c = cycle_for(str(checkout), workbase)
    if c.dry_counts == (0, 0, 0, 0):
        pytest.skip("nothing to patch in this checkout (test_no_cast_means_nothing_to_change covers it)")
    assert c.again_rc == 0 and "nothing to do" in c.again_out, c.again_out
    assert c.again_same_head and c.again_clean and c.again_same_tree
    assert c.status_rc == 0 and c.status_out.startswith("patched"), c.status_out


@real
def test_revert_restores_every_byte(checkout, workbase):
    c = cycle_for(str(checkout), workbase)
    if c.dry_counts == (0, 0, 0, 0):
        pytest.skip("nothing to patch in this checkout (test_no_cast_means_nothing_to_change covers it)")
    assert c.revert_rc == 0, c.revert_out
    assert c.revert_exact, f"files differing from the original commit: {c.revert_diff[:10]}"
    assert c.revert_tree_same_as_original
    assert c.status_after_revert.startswith("not patched"), c.status_after_revert


@real
def test_no_cast_means_nothing_to_change(checkout, request, workbase):
    """A checkout whose FlashInfer MLA backend has no pool cast (before 2e4babdb0,
    2025-05-15) needs no rewrite: apply must change nothing."""
    if not (checkout / FI_MLA).exists():
        pytest.skip(f"no {FI_MLA} in this checkout")
    if fi_pool_casts(checkout):
        pytest.skip("the FlashInfer MLA backend casts the pool here: there is something to change")
    doc = audit(str(checkout))
    assert [p for p in doc["plan_calls"] if p["fixable"]] == [], "plan calls would be rewritten with no cast"
    c = cycle_for(str(checkout), workbase)
    assert c.counts == () and "nothing to do" in c.apply_out


# -- the oracle itself (no checkout needed) --------------------------------------
PROBE = '''
import torch

K_MODULE = POOL.get_key_buffer(0).to(torch.bfloat16)  # pool


class C:
    def direct(self, pool, dt):
        return pool.get_key_buffer(0).to(dt)  # pool

    def named_view(self, pool, dt):
        k = pool.get_value_buffer(0).view(-1, 576)
        return k[:, :, :512].to(dt)  # pool

    def gathered(self, pool, dt, idx):
        k = pool.get_key_buffer(0)
        return k[idx].float()  # gathered

    def index_select(self, pool, dt, idx):
        return torch.index_select(pool.get_key_buffer(0), 0, idx).to(dt)  # gathered

    def kv_tuple(self, pool, dt):
        k, v = pool.get_kv_buffer(0)
        kv = pool.get_kv_buffer(1)
        return k.to(dt), kv[1].half()  # pool pool

    def closure(self, pool, dt):
        k = pool.get_key_buffer(0)

        def inner():
            return k.to(dt)  # pool

        return inner()

    def maybe(self, pool, dt, c, other):
        buf = other if c else pool.get_key_buffer(0)
        return buf.to(dt)  # mixed

    def moves(self, pool, dev, dt):
        pool.get_key_buffer(0).to("cpu")  # device-only
        pool.get_key_buffer(0).to(dev, dt)  # pool
        pool.get_key_buffer(0).to(device=dev)  # device-only

    def not_kv(self, x, dt):
        y = x.to(dt)
        return self.get_buffer(0).to(dt)
'''


def test_oracle_finds_what_its_definition_says():
    """The oracle is only as good as its own rules: check them on a probe."""
    o = oracle()
    hits = o.scan_source("probe.py", PROBE, o.POOL_GETTERS, o.TUPLE_GETTERS)
    want = []
    for i, line in enumerate(PROBE.splitlines(), 1):
        if "  # " in line and not line.lstrip().startswith("#"):
            want += [(i, k) for k in line.rsplit("  # ", 1)[1].split()]
    got = [(h.line, "device-only" if h.device_only else h.kind) for h in hits]
    assert sorted(got) == sorted(want)


# -- as a script: the notes table --------------------------------------------------
def row(checkout: Path) -> str:
    doc = audit(str(checkout))
    hits, _ = oracle_hits(checkout)
    res = oracle().compare(hits, doc)
    with tempfile.TemporaryDirectory(prefix="kvpatch-real-") as base:
        c = cycle_for(str(checkout), Path(base))
    date = git(checkout, "log", "-1", "--format=%ad", "--date=short")
    sha = git(checkout, "rev-parse", "--short=9", "HEAD")
    s = doc["summary"]
    statuses = "/".join(str(s.get(k, 0)) for k in ("hot", "patched", "no-op", "unsupported", "gathered",
                                                   "fixed-upstream"))
    plans = doc["plan_calls"]
    plan_txt = f"{len(plans)} ({sum(p['fixable'] for p in plans)} rewrite)"
    fi = f"{c.counts[1]} sites, {c.counts[2]} plans" if c.counts else "none"
    oracle_txt = f"{len(res['matched'])}/{len(res['only_oracle'])}/{len(res['only_kvpatch'] or [])}"
    ok = lambda b: "yes" if b else "**NO**"  # noqa: E731
    idem = c.again_rc == 0 and "nothing to do" in c.again_out and c.again_same_head and c.again_clean \
        and c.again_same_tree
    return (f"| {date} | {sha} | {doc['files_scanned']} ({doc['candidate_files']}) | {statuses} | {plan_txt} "
            f"| {fi} | {ok(c.apply_rc == 0 and not c.compile_errors)} | {ok(idem)} "
            f"| {ok(c.status_out.startswith('patched'))} | {ok(c.revert_exact and c.revert_tree_same_as_original)} "
            f"| {oracle_txt} | {doc['seconds']:.2f} s ({doc['_table_seconds']:.2f} s) |")


HEADER = ("| date | sha | files scanned (candidates) | hot/patched/no-op/unsupported/gathered/fixed-upstream "
          "| plan calls | FlashInfer rewritten | compiles | idempotent | status patched | revert exact "
          "| oracle matched/only-oracle/only-kvpatch | audit time json (table) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")

if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or [Path(p) for p in CHECKOUTS]
    print(HEADER)
    for p in paths:
        print(row(p), flush=True)
