"""Which files of a patched checkout to verify, and their original text (no torch)."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from kvpatch.analysis.helpers import SPARSE_KERNELS
from kvpatch.analysis.pagedcall import AITER_DECODE_KERNEL, AITER_EXTEND_KERNEL
from kvpatch.checkout import git
from kvpatch.checkout.safepath import UnsafePath, inside, is_link, read_regular
from kvpatch.names import RUNTIME_ALIAS, RUNTIME_FILENAME, RUNTIME_MODULE as RUNTIME_NAME, SKIP_DIRS
from kvpatch.names import STATE_DIR, STATE_FILE
from kvpatch.checkout.originals import OriginalError, copy_path
from kvpatch.checkout.originals import read as read_original
from kvpatch.checkout.state import check_commit

STATE = f"{STATE_DIR}/{STATE_FILE}"

# The classes the harness knows how to drive; a patched file without them is
# reported as skipped (verify covers the FlashInfer MLA backend only).
BACKEND_CLASS = "FlashInferMLAAttnBackend"
DECODE_UPDATER = "FlashInferMLAIndicesUpdaterDecode"
PREFILL_UPDATER = "FlashInferMLAIndicesUpdaterPrefill"
# The page-table family (KVP103), driven by verify/fa3.py.
FA3_CLASS = "FlashAttentionBackend"
FA3_KERNEL = "flash_attn_with_kvcache"
FORWARDS = ("forward_decode", "forward_extend")
FLASHINFER_MLA, FA3 = "flashinfer_mla", "fa3"
# aiter's MHA extend through mha_batch_prefill_func and decode through paged_attention_ragged
# (KVP103's slot-ragged kernels), verify/aiter.py. A backend older than the extend kernel
# (before 2025-09) calls only the decode one.
AITER, AITER_KERNEL = "aiter", AITER_EXTEND_KERNEL
# NSA/DSA's sparse backends (KVP105): forwards hand the cast to self._helper methods that call
# a sparse kernel (the kernels KVP105 knows, FA3's excepted: alone it is the family above),
# verify/sparse.py.
SPARSE = "sparse"
SPARSE_ONLY = frozenset(SPARSE_KERNELS) - {FA3_KERNEL}
# A file whose patch only deletes dead casts (KVP104: no runtime import), verify/deadstore.py.
DEADSTORE = "deadstore"


@dataclass
class Target:
    rel: str                     # checkout-relative posix path of the patched file
    path: Path                   # the patched file itself (the code under test)
    original: Optional[str]      # original source text, None when not found
    original_from: str           # where the original came from (for messages)
    runtime: Path                # the sibling _kvpatch_runtime.py
    problem: str = ""            # non-empty: cannot be verified, and why (a failure)
    skip: str = ""               # non-empty: not a file this harness drives (not a failure)
    family: str = FLASHINFER_MLA  # which driver: FLASHINFER_MLA, FA3, AITER, SPARSE or DEADSTORE
    cls: str = ""                # FA3, AITER, SPARSE: the class to drive


def qualname_map(source: str) -> List[Tuple[int, int, str]]:
    """(first line, last line, Class.method) of every function, innermost last."""
    out: List[Tuple[int, int, str]] = []

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                if not isinstance(child, ast.ClassDef):
                    out.append((child.lineno, getattr(child, "end_lineno", child.lineno), name))
                walk(child, name)

    try:
        walk(ast.parse(source), "")
    except SyntaxError:
        pass
    return out


def qualname_at(qmap: List[Tuple[int, int, str]], line: int) -> str:
    best = ""
    for first, last, name in qmap:
        if first <= line <= last:
            best = name  # later entries are nested deeper
    return best or "<module>"


def _base_names(cls: ast.ClassDef) -> set:
    return {b.id if isinstance(b, ast.Name) else b.attr for b in cls.bases
            if isinstance(b, (ast.Name, ast.Attribute))}


def backend_family(source: str) -> Tuple[str, str]:
    """(family, class to drive): FLASHINFER_MLA if the file defines the FlashInfer MLA
    backend and its updaters; FA3 with the class if it defines FlashAttentionBackend or a
    subclass of it (MUSA's MusaFlashAttentionBackend overrides both forwards with its own
    sites); SPARSE with the first class whose forwards hand the cast to helper methods that
    call a sparse kernel (NSA/DSA, KVP105); FA3 or AITER with a class whose forwards call
    that kernel by name; else ("", ""). SyntaxError propagates."""
    tree = ast.parse(source)
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    names = {n.name for n in classes}
    if {BACKEND_CLASS, DECODE_UPDATER, PREFILL_UPDATER} <= names:
        return FLASHINFER_MLA, BACKEND_CLASS
    if FA3_CLASS in names:
        return FA3, FA3_CLASS
    sub = [n.name for n in classes if FA3_CLASS in _base_names(n)]
    if sub:
        return FA3, sub[0]
    # Before FA3's kernel by name: NSA's `_forward_fa3` helper calls it too, but the class is
    # recognised by its helpers' sparse kernels (the structure KVP105 rewrites), not its name.
    sparse = [n.name for n in classes if _helpers_call(n, SPARSE_ONLY)]
    if sparse:
        return SPARSE, sparse[0]
    # Any other backend whose forwards call FA3's kernel by name (XPU's extend): the
    # reference kernel stands in for it as for FA3 itself.
    own = [n.name for n in classes if _forwards_call(n, FA3_KERNEL)]
    if own:
        return FA3, own[0]
    aiter = [n.name for n in classes if _forwards_call(n, AITER_KERNEL) or _forwards_call(n, AITER_DECODE_KERNEL)]
    return (AITER, aiter[0]) if aiter else ("", "")


def _forwards_call(cls: ast.ClassDef, func: str) -> bool:
    for fn in cls.body:
        if isinstance(fn, ast.FunctionDef) and fn.name in FORWARDS:
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and func in (_name(node.func), _routed_kernel(node)):
                    return True
    return False


def _helpers_call(cls: ast.ClassDef, funcs) -> bool:
    """A forward of cls calls `self.<m>(...)`, a method of cls that calls one of funcs."""
    methods = {fn.name: fn for fn in cls.body if isinstance(fn, ast.FunctionDef)}
    for fn in (methods.get(f) for f in FORWARDS):
        for node in ast.walk(fn) if fn is not None else ():
            f = node.func if isinstance(node, ast.Call) else None
            helper = (methods.get(f.attr) if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                      and f.value.id == "self" and f.attr not in FORWARDS else None)
            if helper is not None and any(isinstance(n, ast.Call) and _name(n.func) in funcs
                                          for n in ast.walk(helper)):
                return True
    return False


def _name(f: ast.expr) -> Optional[str]:
    return f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)


def _routed_kernel(call: ast.Call) -> Optional[str]:
    """`kernel` of a call routed through the runtime, `_kvpatch_rt.<fn>(kernel, ...)`."""
    f = call.func
    if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == RUNTIME_ALIAS
            and call.args and not isinstance(call.args[0], ast.Starred)):
        return _name(call.args[0])
    return None


def _git(root: Path, cmd: str, *args: str) -> Optional[str]:
    try:
        return git.query(root, cmd, *args)
    except git.GitMissing:
        return None


def _git_base(root: Path) -> Optional[str]:
    """HEAD~1 when HEAD is kvpatch's own commit, else HEAD."""
    msg = _git(root, "log", "-1", "--format=%s", "HEAD")
    if msg is None:
        return None
    return "HEAD~1" if msg.strip().startswith("kvpatch:") else "HEAD"


def _git_original(root: Path, rel: str) -> Tuple[Optional[str], str]:
    base = _git_base(root)
    if base is None:
        return None, f"no {STATE} and not a git checkout"
    prefix = (_git(root, "rev-parse", "--show-prefix") or "").strip()
    text = _git(root, "cat-file", "--filters", f"{base}:{prefix}{rel}")  # the bytes a checkout writes
    if text is None:
        return None, f"git has no {base}:{prefix}{rel}"
    return text, f"git {base}:{prefix}{rel}"


def _scan_patched(root: Path) -> List[str]:
    """Checkout-relative paths of files that import the injected runtime."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn == RUNTIME_FILENAME:
                continue
            p = Path(dirpath) / fn
            try:  # never through a link, never blocking on a FIFO
                if RUNTIME_NAME.encode() in read_regular(p):
                    found.append(p.relative_to(root).as_posix())
            except (OSError, UnsafePath):
                continue
    return found


def has_state(root: Path) -> bool:
    """A state file (or a link in its place, which state_entries refuses) exists."""
    p = Path(root) / STATE
    return p.is_file() or is_link(p)


def state_entries(root: Path) -> List[Dict]:
    """The file entries of ``root``'s kvpatch state, every path in them checked.

    A fork may ship a state: it is read never through a link, and a path that
    leaves the checkout raises UnsafePath before anything it names is read.
    Needs no torch, so the CLI checks this before it asks for torch.
    """
    state = json.loads(read_regular(Path(root) / STATE).decode("utf-8"))
    entries = list(state.get("files") or [])
    for e in entries:
        inside(root, e.get("path"), "patched file")
        if e.get("original_copy") is not None:
            inside(root, e["original_copy"], f"original copy of {e.get('path')}")
        check_commit(e.get("original_commit"), str(e.get("path")))
    return entries


def find_targets(root: Path) -> Tuple[List[Target], List[str]]:
    """The files to verify and notes on how they were found."""
    root = Path(root)
    notes: List[str] = []
    entries: List[Dict] = []
    state_path = root / STATE
    from_state = has_state(root)
    if from_state:
        try:
            entries = state_entries(root)
            notes.append(f"targets from {STATE}")
        except UnsafePath as exc:
            return [Target(STATE, state_path, None, "", state_path,
                           problem=f"{state_path}: unsafe kvpatch state, nothing was read ({exc})")], notes
        except (OSError, ValueError, AttributeError) as exc:
            return [Target(STATE, state_path, None, "", state_path,
                           problem=f"unreadable {STATE}: {exc}")], notes
    else:
        entries = [{"path": rel} for rel in _scan_patched(root)]
        notes.append(f"no {STATE}: targets are the files that import "
                     f"{RUNTIME_NAME}, originals from git")

    targets = []
    for e in entries:
        rel = str(e.get("path", "")).replace(os.sep, "/")
        path = root / rel
        t = Target(rel, path, None, "", path.parent / RUNTIME_FILENAME)
        targets.append(t)
        if not path.is_file():
            t.problem = f"patched file {rel} is missing"
            continue
        if from_state:
            copy, commit = e.get("original_copy"), e.get("original_commit")
            if copy is None and commit is None:
                copy = copy_path(rel)  # a state from before originals were read from git
            try:
                t.original = read_original(root, rel, copy, commit, e.get("original_sha256")).decode("utf-8")
            except OriginalError as exc:
                t.problem = str(exc)
                continue
            t.original_from = copy if copy is not None else f"git {commit[:12]}:{rel}"
        else:
            t.original, t.original_from = _git_original(root, rel)
            if t.original is None:
                t.problem = f"original of {rel} not found ({t.original_from})"
                continue
        patched = read_regular(path).decode("utf-8")
        try:
            t.family, t.cls = backend_family(patched)
        except SyntaxError as exc:
            t.problem = f"patched file {rel} does not parse: line {exc.lineno}: {exc.msg}"
            continue
        if not t.family and RUNTIME_NAME not in patched and patched != t.original:
            t.family = DEADSTORE  # deletions only: checked symbolically, no runtime to find
        elif not t.family:
            t.skip = (f"{rel}: no {BACKEND_CLASS} with its indices updaters, no class whose forwards call "
                      f"{FA3_KERNEL} or {AITER_KERNEL}, and none whose forwards hand the cast to helper "
                      f"methods that call a sparse kernel; verify drives those families only")
        elif patched == t.original:
            t.problem = f"{rel} is identical to its original ({t.original_from}): not patched"
        elif RUNTIME_NAME in t.original:
            t.problem = (f"the original of {rel} ({t.original_from}) already imports "
                         f"{RUNTIME_NAME}: not an unpatched original")
        elif t.family != DEADSTORE and (not t.runtime.is_file() or is_link(t.runtime)):
            t.problem = f"runtime {t.runtime.relative_to(root).as_posix()} is missing"
    return targets, notes
