"""engine: run the rules over a file, and over a tree.

discover (bytes) -> locate (ast) -> parse units (libcst) -> find candidates ->
classify -> rules decide -> Site / PlanCall records (+ edits for apply).
``scan_tree`` spreads files over worker processes; only plain records cross
the process boundary, so ``apply`` re-analyses the few files it rewrites.
"""

from __future__ import annotations

import ast
import gc
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Union

import libcst as cst

from kvpatch import selection
from kvpatch.analysis import discover, suppress, workers
from kvpatch.analysis.candidates import CastCandidate, PlanCandidate, bind_plan_args, calls_in, is_mla_plan
from kvpatch.analysis.classify import prove_noop, unreachable
from kvpatch.analysis.locate import locate
from kvpatch.analysis.match import FileContext, UnitContext, consumer_names, is_attr
from kvpatch.analysis.units import ParsedUnit, UnitParseError, decode, parse_unit, split_lines
from kvpatch.names import MLA_PLAN_FUNCTIONS, POOL_GETTERS
from kvpatch.rule import Decision, Rule, load_rules
from kvpatch.sites import (FIXED_UPSTREAM, HOT, NOOP, PATCHED, FileError, FileRecords, PlanCall,  # noqa: F401
                           ScanResult, Site, backend_name, path_kind)  # ScanResult: re-exported



@dataclass
class Decided:
    """A candidate with the decision taken for it (kept for apply)."""

    record: Union[Site, PlanCall]
    decision: Optional[Decision]
    rule: Optional[Rule]
    # The candidate's call and its statement line in the unit's tree: the
    # rewrite follows them into the new file to record where the site went.
    node: Optional[cst.CSTNode] = None
    statement: Optional[cst.CSTNode] = None


@dataclass
class FileAnalysis:
    rel: str
    text: str = ""
    lines: List[str] = field(default_factory=list)
    encoding: str = "utf-8"
    bom: bool = False
    sites: List[Site] = field(default_factory=list)
    plans: List[PlanCall] = field(default_factory=list)
    errors: List[FileError] = field(default_factory=list)
    decided: List[Decided] = field(default_factory=list)
    units: Dict[str, ParsedUnit] = field(default_factory=dict)
    import_after_line: int = 0
    has_runtime_import: bool = False
    first_stmt_docstring_end: int = 0

    @property
    def fixable(self) -> bool:
        return any(d.decision is not None and d.decision.fixable for d in self.decided)

    def records(self) -> "FileRecords":
        return FileRecords(self.rel, self.sites, self.plans, self.errors, self.fixable)


# -- per file --------------------------------------------------------------
def analyze_source(rel: str, data: bytes, rules: Sequence[Rule]) -> FileAnalysis:
    # The cyclic GC is paused while one file is analysed: libcst's trees are freed by reference
    # counts, and its generation-0 passes over their many small objects cost ~15% of audit's
    # CPU. It resumes after each file (anything cyclic left is collected then).
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _analyze_source(rel, data, rules)
    except RecursionError:
        # ast, libcst and the locators all recurse per nesting level: a file
        # nested too deeply for them is unparseable for kvpatch, like a
        # syntax error, and the other files go on.
        fa = FileAnalysis(rel)
        fa.errors.append(FileError(rel, "does not parse: nested too deeply to analyse"))
        return fa
    finally:
        if paused:
            gc.enable()


def _analyze_source(rel: str, data: bytes, rules: Sequence[Rule]) -> FileAnalysis:
    fa = FileAnalysis(rel)
    try:
        fa.text, fa.encoding, fa.bom = decode(data)
    except (UnicodeDecodeError, SyntaxError, LookupError) as exc:
        fa.errors.append(FileError(rel, f"not decodable as Python source ({exc.__class__.__name__}: {exc})"))
        return fa
    try:
        tree = ast.parse(fa.text)
    except SyntaxError as exc:
        fa.errors.append(FileError(rel, f"does not parse: {exc.msg}", exc.lineno))
        return fa
    except ValueError as exc:  # e.g. null bytes
        fa.errors.append(FileError(rel, f"does not parse: {exc}"))
        return fa
    fa.lines = split_lines(fa.text)
    loc = locate(tree, fa.text, frozenset(e for r in rules for e in r.EMITS))
    fa.import_after_line = loc.module.import_after_line
    fa.has_runtime_import = loc.module.runtime_alias is not None
    if tree.body and isinstance(tree.body[0], ast.Expr) and isinstance(getattr(tree.body[0], "value", None), ast.Constant) \
            and isinstance(tree.body[0].value.value, str):
        fa.first_stmt_docstring_end = tree.body[0].end_lineno or 0
    if not loc.units:
        return fa
    for u in loc.units:
        try:
            fa.units[u.qualname] = parse_unit(fa.lines, u)
        except UnitParseError as exc:
            fa.errors.append(FileError(rel, f"cannot analyse {exc}", u.start))
    file_ctx = FileContext(rel, loc.module, loc.classes, fa.units, fa.lines)
    cast_rules = [r for r in rules if r.KIND == "cast" and not r.FALLBACK]
    fallback = next((r for r in rules if r.KIND == "cast" and r.FALLBACK), None)
    plan_rules = [r for r in rules if r.KIND == "plan"]
    for pu in fa.units.values():
        if not pu.unit.why & {"kvbuf", "patched", "plan"}:
            continue
        ctx = UnitContext(pu, file_ctx)
        _analyze_unit(fa, ctx, rules, cast_rules, fallback, plan_rules)
    suppress.apply(fa, tree)  # before pairing: a suppressed cast rewrites nothing, nor do its plans
    selection.pair(fa)
    selection.select(fa, rules)
    fa.sites.sort(key=lambda s: (s.line, s.column))
    fa.plans.sort(key=lambda p: p.line)
    return fa


def _site(ctx: UnitContext, node: cst.CSTNode, *, buffer: str, dtype: str, form: str, kernel: str,
          status: str, reason: str, rule: Optional[str], fixable=False, notes=()) -> Site:
    return Site(
        file=ctx.file.rel, line=ctx.line(node), end_line=ctx.end_line(node), column=ctx.column(node),
        qualname=ctx.unit.qualname, path=path_kind(ctx.unit.qualname), backend=backend_name(ctx.file.rel),
        buffer=buffer, dtype=dtype, form=form, kernel=kernel, status=status, reason=reason, rule=rule,
        fixable=fixable, statement=ctx.code(ctx.line_statement(node)), notes=list(notes),
    )


def _first(rules, hook: str, node, ctx: UnitContext):
    """(rule, answer) of the first rule whose `hook` (decide, patched,
    fixed_upstream) answers for `node`; (None, None) if none does."""
    for r in rules:
        got = getattr(r, hook)(node, ctx)
        if got is not None:
            return r, got
    return None, None


def _analyze_unit(fa: FileAnalysis, ctx: UnitContext, rules, cast_rules, fallback, plan_rules) -> None:
    cast_getters = set()  # getters whose buffer some cast in this function reads
    direct: List[cst.Call] = []
    for call in calls_in(ctx.func, ctx):
        func = call.func
        # -- a site a rule already rewrote -------------------------------------
        owner, got = _first(rules, "patched", call, ctx)
        if got is not None:
            # Its pool was cast (now page-gathered): not an uncast "direct" pool below.
            cast_getters.update(ctx.origin(got.buffer).getters)
            fa.sites.append(_site(
                ctx, call, buffer=ctx.code(got.buffer),
                dtype=ctx.code(got.dtype) if got.dtype is not None else "(none)",
                form="patched", kernel=consumer_names(ctx.consumers(call), ctx), status=PATCHED,
                reason=got.reason, rule=owner.ID))
            continue
        # -- MLA plan calls ----------------------------------------------------
        plan: Optional[PlanCandidate] = None
        if is_mla_plan(call):
            args = bind_plan_args(call)
            if args is not None:
                kw = any(a.keyword is not None and a.keyword.value in ("q_data_type", "kv_data_type")
                         for a in call.args)
                plan = PlanCandidate(call, func.value, "keyword" if kw else "positional", args)
        elif isinstance(func, cst.Name) and func.value in MLA_PLAN_FUNCTIONS:
            plan = PlanCandidate(call, None, "function", bind_plan_args(call, skip_first=True) or {})
        if plan is not None:
            _decide_plan(fa, ctx, plan, plan_rules)
            continue
        # -- casts of a KV buffer ------------------------------------------------
        form = ctx.cast_form(call)
        if form is not None:
            receiver = func.value
            origin = ctx.origin(receiver)
            if origin.kind is None:
                continue
            consumers = ctx.consumers(call)
            cand = CastCandidate(call, receiver, form, origin, consumers)
            cast_getters.update(origin.getters)
            _decide_cast(fa, ctx, cand, cast_rules, fallback)
            continue
        if is_attr(func, POOL_GETTERS):
            direct.append(call)
    # -- a pool read no cast touched: an upstream fix some rule recognises --
    for call in direct:
        if call not in cast_getters:
            owner, got = _first(rules, "fixed_upstream", call, ctx)
            if got is not None:
                fa.sites.append(_site(
                    ctx, call, buffer=ctx.code(call), dtype="(none)", form="direct", kernel=got.kernel,
                    status=FIXED_UPSTREAM, reason=got.reason, rule=owner.ID))


def _cast_form_name(cand: CastCandidate, ctx: UnitContext) -> str:
    if cand.origin.via_names:
        return "two-statement"
    par = ctx.parent(cand.call)
    if isinstance(par, (cst.Assign, cst.AnnAssign)):
        return "assignment"
    return "inline"


def _decide_cast(fa: FileAnalysis, ctx: UnitContext, cand: CastCandidate, cast_rules, fallback) -> None:
    decision: Optional[Decision] = None
    rule: Optional[Rule] = None
    never = unreachable(cand.call, ctx)
    if never:
        decision, rule = Decision(NOOP, never), fallback
    elif cand.origin.kind == "pool":
        verdict = prove_noop(cand.form, ctx)
        if verdict.noop:
            decision, rule = Decision(NOOP, verdict.reason), fallback
        else:
            cand.guard_note = verdict.reason
            rule, decision = selection.hand_on(cast_rules, *_first(cast_rules, "decide", cand, ctx),
                                               lambda later: _first(later, "decide", cand, ctx))
    if decision is None and fallback is not None:
        decision, rule = fallback.decide(cand, ctx), fallback
    if decision is None:
        decision = Decision(HOT, "full-pool cast; no rule handles it")
    buffer = cand.origin.getters[0] if cand.origin.getters else cand.receiver
    site = _site(
        ctx, cand.call, buffer=ctx.code(buffer), dtype=ctx.code(cand.form.dtype) if cand.form.dtype is not None
        else f".{cand.form.method}()", form=_cast_form_name(cand, ctx),
        kernel=consumer_names(cand.consumers, ctx), status=decision.status, reason=decision.reason,
        rule=rule.ID if rule else None, fixable=decision.fixable, notes=decision.notes)
    fa.sites.append(site)
    fa.decided.append(Decided(site, decision, rule, cand.call, ctx.line_statement(cand.call)))


def _decide_plan(fa: FileAnalysis, ctx: UnitContext, cand: PlanCandidate, plan_rules) -> None:
    rule, decision = _first(plan_rules, "decide", cand, ctx)

    def code(name):
        a = cand.arg(name)
        return ctx.code(a.value) if a is not None else None

    from kvpatch.sites import PLAN_UNSUPPORTED

    if decision is None:
        decision = Decision(PLAN_UNSUPPORTED, "no rule handles MLA plan calls")
    rec = PlanCall(
        file=ctx.file.rel, line=ctx.line(cand.call), qualname=ctx.unit.qualname,
        receiver=ctx.code(cand.receiver) if cand.receiver is not None else
        (ctx.code(cand.call.args[0].value) if cand.call.args else "?"),
        form=cand.form, q_dtype=code("q_data_type"), kv_dtype=code("kv_data_type"),
        page_size=code("page_size"), causal=code("causal"), status=decision.status,
        reason=decision.reason, rule=rule.ID if rule else None, fixable=decision.fixable,
        statement=ctx.code(ctx.line_statement(cand.call)),
    )
    fa.plans.append(rec)
    fa.decided.append(Decided(rec, decision, rule, cand.call, ctx.line_statement(cand.call)))


# -- a whole tree (ScanResult: kvpatch.sites) -------------------------------
def _read_chunk(args) -> list:
    root, indexed = args
    return discover.read_candidates(root, indexed)


def _analyze_files(sources, select, plan) -> List[FileRecords]:
    rules = load_rules(select)
    out: List[FileRecords] = []
    for src in sources:
        fa = analyze_source(src.rel, src.data, rules)
        rec = fa.records()
        if plan is not None and rec.fixable:
            rec.planned = plan(fa, rules)
        out.append(rec)
    return out


def scan_tree(root: Path, select: Optional[Sequence[str]] = None, jobs: Optional[int] = None,
              progress: Optional[Callable[[int, int], None]] = None,
              excluded: Optional[Callable[[str], bool]] = None,
              plan: Optional[Callable[[FileAnalysis, Sequence[Rule]], object]] = None,
              prefetched=None) -> ScanResult:
    """Analyse every candidate file of the tree (in worker processes for a big
    one). `plan`, a module-level function, is called on each fixable file's
    analysis where it was made; its answer travels back as `FileRecords.planned`
    (apply's rewrites: so apply analyses each file once). `prefetched`: audit's
    helper that listed and read the tree already (kvpatch/analysis/prefetch.py)."""
    t0 = time.perf_counter()
    root = root.resolve()
    got = prefetched.take(root, excluded) if prefetched is not None else None
    if got is not None:
        t0 = min(t0, prefetched.started)  # the scan's time includes the helper's
        paths = None
        total, found = got
    else:
        paths = list(discover.iter_python_paths(root, excluded))
        total, found = len(paths), None
    load_rules(select)  # fail fast on an unknown rule name
    jobs = workers.effective_jobs(jobs)
    if total < 200:
        jobs = 1  # a small tree costs less than a worker start
    executor = workers.pool(jobs) if jobs > 1 else None
    try:
        # 1. which files can hold a site: read and byte-filtered in chunks, unless prefetched.
        if found is None and executor is not None:
            chunks = discover.chunk(list(enumerate(paths)), jobs * 4)
            found = [x for part in executor.map(_read_chunk, [(root, c) for c in chunks]) for x in part]
        elif found is None:
            found = discover.read_candidates(root, enumerate(paths))
        found.sort(key=lambda x: x[0])  # read errors in path order, however the chunks fell
        errors = [FileError(x.rel, x.message) for _, x in found if isinstance(x, discover.ReadError)]
        sources = [x for _, x in found if isinstance(x, discover.SourceFile)]
        # 2. each candidate analysed, the largest first.
        done = total - len(sources)
        if progress:
            progress(done, total)
        files: List[FileRecords] = []
        for rec in workers.largest_first(executor, _analyze_files, sources, lambda s: len(s.data), select, plan):
            files.append(rec)
            done += 1
            if progress:
                progress(done, total)
    finally:
        if executor is not None:
            executor.shutdown(cancel_futures=True)
    files.sort(key=lambda f: f.rel)
    return ScanResult(root, total, len(files), files, errors, time.perf_counter() - t0)
