"""patch: audit -> plan -> rewrite -> write, for `apply`.

`build` computes everything `apply` would do without touching the disk (that
is `--dry-run`); `apply` writes it through ``write.apply_writes`` (all files or
none) and records ``.kvpatch/state.json``. `revert` (kvpatch/revert.py) restores
the recorded originals byte for byte; `status` (kvpatch/status.py) compares the
checkout with its record; kvpatch/checkout/guarded.py holds the steps both writers share.
"""

from __future__ import annotations

import datetime as _dt
import difflib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from kvpatch import RULESET_VERSION, __version__
from kvpatch.checkout import envfail
from kvpatch.checkout import repo
from kvpatch.rewrite import choose
from kvpatch.checkout import originals
from kvpatch.checkout import write
from kvpatch.engine import FileAnalysis, scan_tree
from kvpatch.checkout.guarded import (GIT_IGNORE, IGNORE_ALL, PatchError, _git_preflight, _git_record,  # noqa: F401
                             _is_state, _locked, _refuse_pending, _write_and_commit)  # PatchError: the CLI's
from kvpatch.revert import original as revert_original
from kvpatch.rewrite.transform import FileRewrite, RewriteError, plan_rewrite
from kvpatch.rule import load_rules
from kvpatch.runtime import RUNTIME_FILENAME, runtime_source, runtime_version
from kvpatch.checkout.safepath import is_link, read_regular
from kvpatch.sites import NEEDS_ACTION, PATCHED, PLAN_PATCHED, FileError, PlanCall, ScanResult
from kvpatch.checkout.state import (STATE_DIR, STATE_FILE, DeclinedRecord, FileRecord, RuntimeRecord, SiteRecord, State,
                           declined_key, load, sha256)




@dataclass
class RuntimeWrite:
    rel: str
    data: bytes
    old: Optional[bytes]  # None: a new file


@dataclass
class Patch:
    root: Path
    scan: ScanResult
    rewrites: List[FileRewrite] = field(default_factory=list)
    runtimes: List[RuntimeWrite] = field(default_factory=list)
    refused: List[FileError] = field(default_factory=list)  # files whose rewrite was dropped
    # apply -i: the records of the changes answered "no", and of those a "quit" left unasked
    declined: List = field(default_factory=list)
    unasked: List = field(default_factory=list)
    answers: Optional[choose.Selection] = None
    changes: int = 0  # how many changes there were to ask about

    @property
    def sites_rewritten(self) -> int:
        return sum(len(r.sites) for r in self.rewrites)

    @property
    def plans_rewritten(self) -> int:
        return sum(len(r.plans) for r in self.rewrites)

    def skipped(self) -> List:
        """Sites that stay as they are and need action, with their reasons."""
        # The rewrites hold the scan's own records (one analysis per file).
        left = {id(s) for r in self.rewrites for s in r.sites} | {id(s) for s in self.declined + self.unasked}
        return [s for s in self.scan.sites if s.status in NEEDS_ACTION and id(s) not in left]

    @property
    def empty(self) -> bool:
        return not self.rewrites and not self.runtimes

    def diff(self, color: bool = False, runtimes: bool = True) -> str:
        """The unified diff; `runtimes=False` leaves the runtime files out."""
        chunks = []
        for r in self.rewrites:
            chunks.append(_udiff(r.rel, r.old_text, r.new_text))
        for rt in self.runtimes if runtimes else ():
            old = rt.old.decode("utf-8") if rt.old is not None else None
            chunks.append(_udiff(rt.rel, old, rt.data.decode("utf-8")))
        text = "".join(chunks)
        return colorize_diff(text) if color else text


def _udiff(rel: str, old: Optional[str], new: str) -> str:
    a = "/dev/null" if old is None else f"a/{rel}"
    lines = difflib.unified_diff((old or "").splitlines(True), new.splitlines(True), a, f"b/{rel}")
    out = []
    for ln in lines:
        out.append(ln if ln.endswith("\n") else ln + "\n\\ No newline at end of file\n")
    return "".join(out)


def colorize_diff(text: str) -> str:
    import click

    out = []
    for ln in text.splitlines(True):
        body = ln.rstrip("\r\n")
        end = ln[len(body):]  # styled without its newline: each line resets its own colour,
        # so `| head` cutting after any line leaves the terminal plain
        if ln.startswith(("+++", "---")):
            out.append(click.style(body, bold=True) + end)
        elif ln.startswith("@@"):
            out.append(click.style(body, fg="cyan") + end)
        elif ln.startswith("+"):
            out.append(click.style(body, fg="green") + end)
        elif ln.startswith("-"):
            out.append(click.style(body, fg="red") + end)
        else:
            out.append(ln)
    return "".join(out)


def build(root: Path, select: Optional[Sequence[str]] = None, jobs: Optional[int] = None,
          progress: Optional[Callable[[int, int], None]] = None,
          excluded: Optional[Callable[[str], bool]] = None, ask: Optional[choose.Asker] = None) -> Patch:
    """What apply writes. With `ask` (apply -i) each change is asked first and
    only the accepted ones are rewritten; with none accepted, nothing is written."""
    rules = load_rules(select)
    if ask is None:
        scan = scan_tree(root, select, jobs, progress, excluded, plan=_rewrite)
    else:  # the asking needs each fixable file's analysis itself: keep it in this process
        scan = scan_tree(root, select, 1, progress, excluded, plan=_analysis)
    patch = Patch(scan.root, scan)
    # A *.py link was not read (it may lead out of the checkout): apply refuses it.
    links = [e for e in scan.errors if is_link(scan.root / e.file)]
    scan.errors = [e for e in scan.errors if e not in links]
    patch.refused.extend(links)
    runtime_text = runtime_source().encode("utf-8")
    runtime_dirs: Dict[str, None] = {}
    pending: List[Tuple[FileAnalysis, List[choose.Change]]] = []
    for f in scan.files:
        fa, got = None, f.planned
        if ask is not None and got is not None:
            fa, got = got, _rewrite(got, rules)
        if isinstance(got, FileError):
            patch.refused.append(got)
        elif got is not None and got.changed:
            if fa is not None:
                pending.append((fa, choose.changes(fa, rules, got)))
            else:
                patch.rewrites.append(got)
    if ask is not None:
        _ask(patch, rules, pending, ask)
    for rw in patch.rewrites:
        if rw.needs_runtime:
            runtime_dirs[str(PurePosixPath(rw.rel).parent)] = None
    # Files already patched keep their runtime in step with this kvpatch
    # (apply -i with nothing accepted writes nothing at all).
    for f in scan.files if not (ask is not None and not patch.rewrites) else ():
        if any(s.status == PATCHED for s in f.sites) or any(p.status == PLAN_PATCHED for p in f.plans):
            runtime_dirs[str(PurePosixPath(f.rel).parent)] = None
    for d in runtime_dirs:
        rel = RUNTIME_FILENAME if d in ("", ".") else f"{d}/{RUNTIME_FILENAME}"
        p = scan.root / rel
        old = read_regular(p) if p.exists() or is_link(p) else None
        if old != runtime_text:
            patch.runtimes.append(RuntimeWrite(rel, runtime_text, old))
    return patch


def _rewrite(fa: FileAnalysis, rules):
    """scan_tree's `plan` hook for apply, run where the file was analysed: its
    rewrite, or the reason it is refused."""
    try:
        return plan_rewrite(fa, rules)
    except RewriteError as exc:
        return FileError(fa.rel, str(exc))


def _analysis(fa: FileAnalysis, rules) -> FileAnalysis:
    """scan_tree's `plan` hook for apply -i (in this process): the analysis itself."""
    return fa


def _ask(patch: Patch, rules, pending, ask: choose.Asker) -> None:
    every = [c for _, cs in pending for c in cs]
    sel = ask(every)
    i = 0
    for fa, cs in pending:
        picked = []
        for c in cs:
            if i in sel.accepted:
                picked.append(c)
            else:
                (patch.declined if i in sel.declined else patch.unasked).extend(c.records)
            i += 1
        if not picked:
            continue
        try:
            patch.rewrites.append(choose.accepted_rewrite(fa, rules, picked))
        except RewriteError as exc:
            patch.refused.append(FileError(fa.rel, str(exc)))
    patch.answers, patch.changes = sel, len(every)


# -- apply ---------------------------------------------------------------------
@dataclass
class ApplyResult:
    patch: Patch
    written: List[str]
    branch: Optional[str]
    commit: Optional[str]
    git: bool
    notice: str = ""


def _site_records(rw: FileRewrite) -> List[SiteRecord]:
    """Each rewritten site and plan call, where the rewrite put it."""
    return [SiteRecord(d.record.qualname, d.record.rule or "", "plan" if isinstance(d.record, PlanCall) else "cast",
                       d.line, d.record.statement, d.statement, list(d.also)) for d in rw.done]


def commit_message(patch: Patch) -> str:
    lines = [f"kvpatch: page-gathered FP8 KV cast ({patch.sites_rewritten} sites, "
             f"{patch.plans_rewritten} plan calls)", "",
             "Rewritten by kvpatch " + __version__ + " (ruleset " + RULESET_VERSION + "):"]
    for r in patch.rewrites:
        for s in r.sites:
            lines.append(f"- {s.file}:{s.line} {s.qualname} [{s.path}] {s.rule}: {s.buffer}.to({s.dtype})")
        for p in r.plans:
            lines.append(f"- {p.file}:{p.line} {p.qualname} {p.rule}: plan kv dtype {p.kv_dtype}")
    for rt in patch.runtimes:
        lines.append(f"- {rt.rel}: kvpatch runtime {runtime_version()}" + (" (updated)" if rt.old else ""))
    if patch.declined or patch.unasked:
        lines += ["", f"Left as they are (kvpatch apply -i): {len(patch.declined)} declined, "
                      f"{len(patch.unasked)} not asked:"]
        lines += [f"- {r.file}:{r.line} {r.qualname} {r.rule}" for r in patch.declined + patch.unasked]
    return "\n".join(lines) + "\n"


def apply(root: Path, **kw) -> ApplyResult:
    """Rewrite every fixable site (all files or none), holding the checkout's write lock."""
    root = root.resolve()
    with _locked(root):
        return _apply(root, **kw)


def preflight(root: Path, allow_dirty: bool = False):
    """The refusals apply makes before it builds (apply -i makes them before asking
    anything too): a pending journal, an unsafe state, a dirty git tree. Returns
    (the recorded state, git info)."""
    _refuse_pending(root)
    old_state = load(root)  # a crafted state is refused here, before anything is touched
    info = repo.git_info(root)
    if info is not None and not allow_dirty:
        dirty = [p for p in repo.dirty_paths(info, root) if not p.startswith(STATE_DIR)]
        # A file git could not read is listed as changed (seen under load, when its index
        # entry must be re-hashed): say what is wrong with it, as the scan would.
        blocked = envfail.unreadable_paths(info.workdir, dirty)
        if blocked:
            raise PatchError(blocked)
        if dirty:
            raise PatchError(f"the git tree has uncommitted changes ({', '.join(dirty[:3])}"
                             f"{'...' if len(dirty) > 3 else ''}): commit or stash them, or pass --allow-dirty")
    return old_state, info


def _apply(root: Path, *, select=None, allow_dirty=False, no_commit=False, no_verify=False, jobs=None,
           progress=None, patch: Optional[Patch] = None) -> ApplyResult:
    old_state, info = preflight(root, allow_dirty)
    patch = patch or build(root, select, jobs, progress)
    unreadable = envfail.refuse_unreadable(patch.scan.all_errors)  # no silent partial apply (issue 18)
    if unreadable:
        raise PatchError(unreadable)
    if patch.empty:
        return ApplyResult(patch, [], None, None, info is not None, "nothing to do")
    if info is not None and allow_dirty and not no_commit:
        touched = {info.rel_to_repo(root, r.rel) for r in patch.rewrites}
        both = sorted(touched & set(repo.dirty_paths(info, root)))
        if both:
            raise PatchError(f"{both[0]} has uncommitted changes that the kvpatch commit would include: "
                             f"commit them first, or pass --no-commit")

    if info is not None and not no_commit:
        _git_preflight(info)
    writes, state = _apply_writes(root, patch, info, old_state)
    branch = commit_sha = None
    notice = ""
    if info is None:
        notice = f"{repo.plain_reason(root)}: files written in place, no branch or commit"
    elif no_commit:
        notice = "--no-commit: files written in place, no branch or commit"

    def finish():
        nonlocal branch, commit_sha
        if info is None or no_commit:
            return
        orig_branch = info.branch
        branch = repo.branch_name(info, root)
        repo.create_branch(info, branch)
        try:
            # The checkout's files and the state record (issue 18: a clone or a
            # `git clean -fdx` keeps it); the originals are in git at the branch's base.
            record = [info.rel_to_repo(root, f"{STATE_DIR}/{STATE_FILE}")]
            paths = [info.rel_to_repo(root, w.rel) for w in writes if not _is_state(w.rel)] + record
            commit_sha = repo.commit(info, paths, commit_message(patch), no_verify, force=record)
        except BaseException:
            try:
                repo.restore_branch(info, orig_branch, branch)
            except repo.GitError:
                pass  # the commit's error is the one to report
            branch = None
            raise

    _write_and_commit(root, writes, "apply", finish, _git_record(info, no_commit))
    return ApplyResult(patch, [w.rel for w in writes], branch, commit_sha, info is not None, notice)


def _apply_writes(root: Path, patch: Patch, info, old_state: Optional[State]) -> Tuple[List[write.FileWrite], State]:
    writes: List[write.FileWrite] = []
    prior = {f.path: f for f in old_state.files} if old_state else {}
    files: Dict[str, FileRecord] = dict(prior)
    for rw in patch.rewrites:
        rec_prior = prior.get(rw.rel)
        if rec_prior is None:
            original = read_regular(root / rw.rel)
            copy, commit = originals.keep(root, info, rw.rel, original)
            if copy is not None:
                writes.append(write.FileWrite(copy, original))
        else:
            copy, commit = rec_prior.original_copy, rec_prior.original_commit
            original = revert_original(root, rec_prior.path, copy, commit, rec_prior.original_sha256)
        files[rw.rel] = FileRecord(rw.rel, sha256(original), sha256(rw.new_bytes), copy,
                                   (rec_prior.sites if rec_prior else []) + _site_records(rw), commit)
        writes.append(write.FileWrite(rw.rel, rw.new_bytes))
    runtimes = {r.path: r for r in (old_state.runtime_files if old_state else [])}
    for rt in patch.runtimes:
        rec = runtimes.get(rt.rel)
        if rec is None:
            rec = RuntimeRecord(rt.rel, sha256(rt.data), rt.old is None)
            if rt.old is not None:
                rec.original_copy, rec.original_commit = originals.keep(root, info, rt.rel, rt.old)
                rec.original_sha256 = sha256(rt.old)
                if rec.original_copy is not None:
                    writes.append(write.FileWrite(rec.original_copy, rt.old))
        rec.sha256 = sha256(rt.data)
        runtimes[rt.rel] = rec
        writes.append(write.FileWrite(rt.rel, rt.data))
    upstream = old_state.upstream if old_state else {
        "commit": info.commit if info else None,
        "branch": info.branch if info else None,
        "sglang_version": repo.sglang_version(root),
    }
    state = State(
        kvpatch_version=__version__, ruleset_version=RULESET_VERSION, runtime_version=runtime_version(),
        applied_at=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        upstream=upstream, files=sorted(files.values(), key=lambda f: f.path),
        runtime_files=sorted(runtimes.values(), key=lambda r: r.path),
        declined=_declined(patch, old_state),
    )
    writes.append(write.FileWrite(f"{STATE_DIR}/{STATE_FILE}", state.to_json().encode("utf-8")))
    if info is not None and not (root / GIT_IGNORE).exists():
        writes.append(write.FileWrite(GIT_IGNORE, IGNORE_ALL))
    return writes, state


def _declined(patch: Patch, old_state: Optional[State]) -> List[DeclinedRecord]:
    """This apply's "no" answers, and the earlier ones whose site is still left
    unrewritten (an earlier -i's decline stands until a later apply rewrites it)."""
    new = [DeclinedRecord.of(r) for r in patch.declined]
    done = {id(s) for r in patch.rewrites for s in r.sites + r.plans}
    left = Counter(declined_key(r) for r in patch.scan.sites + patch.scan.plans if r.fixable and id(r) not in done)
    left.subtract(Counter(d.key for d in new))
    for d in old_state.declined if old_state else ():
        if left[d.key] > 0:
            left[d.key] -= 1
            new.append(d)
    return sorted(new, key=lambda d: (d.file, d.line))
