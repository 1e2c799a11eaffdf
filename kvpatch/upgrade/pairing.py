"""Pairing old and new sites and plan calls into categorised entries."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple
from kvpatch.sites import PLAN_UNSUPPORTED
from kvpatch.upgrade.gitref import RefTree
from kvpatch.upgrade.inventory import Functions, normalize_statement
from kvpatch.upgrade.model import CHANGED, Entry, FIXED, MOVED, MOVED_SIMILARITY, NEW, PLAN_CATEGORIES, REMOVED, REPLACED, SITE_CATEGORIES, UNCHANGED, UNMATCHED, _ACTION, _HANDLED, _RESOLVED

# -- pairing ---------------------------------------------------------------------
_GETTER = re.compile(r"\.(get_\w+)\s*\(")


def _getter(buffer: str) -> str:
    found = _GETTER.findall(buffer or "")
    return found[-1] if found else ""


def _same(a, b) -> bool:
    return normalize_statement(a.statement) == normalize_statement(b.statement)


def _pair(olds: List, news: List, tiers: Sequence[Callable]) -> Tuple[List[Tuple], List, List]:
    """Pair records tier by tier; within a tier, equal statements first, then in line order."""
    pairs: List[Tuple] = []
    rem_old, rem_new = sorted(olds, key=lambda r: (r.file, r.line)), sorted(news, key=lambda r: (r.file, r.line))
    for tier in tiers:
        by_old: Dict = {}
        for r in rem_old:
            k = tier(r, True)
            if k is not None:
                by_old.setdefault(k, []).append(r)
        by_new: Dict = {}
        for r in rem_new:
            k = tier(r, False)
            if k is not None:
                by_new.setdefault(k, []).append(r)
        used_old, used_new = set(), set()
        for k in by_old:
            os_, ns = by_old[k], by_new.get(k, [])
            if not ns:
                continue
            free = list(ns)
            rest = []
            for o in os_:
                n = next((n for n in free if _same(n, o)), None)
                if n is not None:
                    free.remove(n)
                    pairs.append((o, n))
                    used_old.add(id(o))
                    used_new.add(id(n))
                else:
                    rest.append(o)
            for o, n in zip(rest, free):
                pairs.append((o, n))
                used_old.add(id(o))
                used_new.add(id(n))
        rem_old = [r for r in rem_old if id(r) not in used_old]
        rem_new = [r for r in rem_new if id(r) not in used_new]
    return pairs, rem_old, rem_new


class Trees:
    """Both trees' files, for the questions the pairing asks."""

    def __init__(self, old_root: Optional[Path], new_root: Path, new_candidates: Sequence[str] = (),
                 ref_tree: Optional["RefTree"] = None) -> None:
        self.old = Functions(old_root, ref_tree) if old_root is not None else None
        self.new = Functions(new_root)
        self.new_candidates = list(new_candidates)

    def only_here(self, rec, is_old: bool) -> bool:
        """The record's file exists only on its own side (moved or renamed)."""
        if is_old:
            return not self.new.file_exists(rec.file)
        return self.old is not None and not self.old.file_exists(rec.file)

    def fn_only_here(self, rec, is_old: bool) -> bool:
        """The record's function exists only on its own side."""
        if is_old:
            return not self.new.present(rec.file, rec.qualname)
        return self.old is not None and not self.old.present(rec.file, rec.qualname)

    def moved_to(self, rec) -> Optional[Tuple[str, str, float]]:
        """Where an old record's vanished function went: the most similar
        function of the same name among the new tree's candidate files."""
        if self.old is None:
            return None
        src = self.old.lines_of(rec.file, rec.qualname)
        if not src:
            return None
        name = rec.qualname.rsplit(".", 1)[-1]
        best: Optional[Tuple[str, str, float]] = None
        for rel in self.new_candidates:
            for q in self.new.qualnames(rel):
                if q.rsplit(".", 1)[-1] != name or (rel == rec.file and q == rec.qualname):
                    continue
                if self.old.present(rel, q):
                    continue  # it was there already: not where this one went
                other = self.new.lines_of(rel, q)
                sm = difflib.SequenceMatcher(None, src, other, autojunk=False)
                if sm.real_quick_ratio() < MOVED_SIMILARITY or sm.quick_ratio() < MOVED_SIMILARITY:
                    continue
                r = sm.ratio()
                if r >= MOVED_SIMILARITY and (best is None or r > best[2]):
                    best = (rel, q, r)
        return best


def _by_function(records) -> Dict[Tuple[str, str], List]:
    """records grouped by (file, qualname), in order."""
    out: Dict[Tuple[str, str], List] = {}
    for r in records:
        out.setdefault((r.file, r.qualname), []).append(r)
    return out


def _nb(buffer: Optional[str]) -> str:
    """A buffer expression without its layout (a reformat keeps the identity)."""
    return re.sub(r",\)", ")", re.sub(r"\s+", "", buffer or ""))


def _site_tiers(t: Trees) -> List[Callable]:
    direct = lambda s: s.form == "direct"  # noqa: E731 - a pool with no cast pairs only with its kind
    return [
        lambda s, old: (s.file, s.qualname, s.rule, _nb(s.buffer), direct(s)),
        lambda s, old: (s.file, s.qualname, _nb(s.buffer), direct(s)),  # the rule changed
        lambda s, old: (s.file, s.qualname, s.rule, _getter(s.buffer), direct(s)),  # the buffer expression changed
        # the file moved: an old record whose file is gone, a new one whose file is new
        lambda s, old: (s.qualname, s.rule, _nb(s.buffer), direct(s)) if t.only_here(s, old) else None,
        # the function moved or was renamed, the statement kept
        lambda s, old: (s.rule, _nb(s.buffer), direct(s), normalize_statement(s.statement))
        if t.fn_only_here(s, old) else None,
        # a cast that needed action is gone and the same pool now reaches the kernel uncast:
        # fixed upstream (the other way round, a cast arriving, stays a new site)
        lambda s, old: (s.file, s.qualname, _nb(s.buffer))
        if (old and not direct(s) and s.status in _ACTION + _HANDLED) or (not old and direct(s)) else None,
    ]


def _plan_tiers(t: Trees) -> List[Callable]:
    return [
        lambda p, old: (p.file, p.qualname, p.receiver),
        lambda p, old: (p.file, p.qualname, p.form),
        lambda p, old: (p.qualname, p.receiver, p.form) if t.only_here(p, old) else None,
        lambda p, old: (p.receiver, normalize_statement(p.statement)) if t.fn_only_here(p, old) else None,
    ]


def _needs(rec) -> bool:
    """Needs a person: hot/unsupported and not something apply rewrites."""
    return rec.status in _ACTION and not rec.fixable


def _s(rec) -> str:
    return f"{rec.status}{', ' + rec.rule if rec.rule else ''}{', apply rewrites it' if rec.fixable else ''}"


def _one(text: Optional[str]) -> str:
    return " ".join((text or "").split())


def _relocated(o, n) -> str:
    if o.file != n.file:
        return f"moved from {o.file}::{o.qualname}" if o.qualname != n.qualname else f"file moved from {o.file}"
    if o.qualname != n.qualname:
        return f"function renamed from {o.qualname}"
    return ""


def compare_sites(old_sites: List, new_sites: List, t: Trees) -> List[Entry]:
    pairs, only_old, only_new = _pair(old_sites, new_sites, _site_tiers(t))
    out: List[Entry] = []
    for o, n in pairs:
        same = _same(o, n)
        e = Entry(UNCHANGED, o, n, statement_changed=not same)
        where = _relocated(o, n)
        if (o.status in _ACTION + _HANDLED) and n.status in _RESOLVED:
            e.category = FIXED
            e.why = f"{o.status} -> {n.status}: {_one(n.reason)}"
        elif same:
            e.category = UNCHANGED if o.line == n.line and not where else MOVED
            e.why = "same statement" + (f", line {o.line} -> {n.line}" if o.line != n.line else "")
        else:
            e.category = CHANGED
            what = []
            if o.rule != n.rule:
                what.append(f"rule {o.rule} -> {n.rule}")
            if _nb(o.buffer) != _nb(n.buffer):
                what.append(f"buffer `{_one(o.buffer)}` -> `{_one(n.buffer)}`")
            e.why = "statement changed" + (f" ({'; '.join(what)})" if what else "")
        if where:
            e.why += f"; {where}"
        if o.status != n.status and e.category != FIXED:
            e.why += f"; status {o.status} -> {n.status}"
        became_action = n.status in _ACTION and o.status not in _ACTION + _HANDLED
        lost_fix = _needs(n) and (o.fixable or o.status in _HANDLED)
        if became_action or lost_fix:
            e.action = True
            e.why += f"; now {_s(n)}: {_one(n.reason)}"
            e.action_why = f"became {_s(n)}" if became_action else "apply no longer rewrites it"
        out.append(e)
    for n in only_new:
        e = Entry(NEW, None, n, statement_changed=True)
        e.why = _one(n.reason)
        e.action = n.status in _ACTION
        e.action_why = f"new {_s(n)}"
        out.append(e)
    new_by_fn = _by_function(new_sites)
    for o in only_old:
        e = Entry(REMOVED, o, None, statement_changed=True)
        file, qualname, moved = o.file, o.qualname, ""
        if not t.new.present(o.file, o.qualname):
            dest = t.moved_to(o)
            if dest is None:
                gone = "the file is gone" if not t.new.file_exists(o.file) else f"`{o.qualname}` is gone from {o.file}"
                e.why = f"{gone} (was {o.status})"
                out.append(e)
                continue
            file, qualname = dest[0], dest[1]
            moved = f"`{o.qualname}` is gone, and {file}::{qualname} ({dest[2]:.0%} like it) "
        others = new_by_fn.get((file, qualname), [])
        if others:
            e.replaced_by = [s.key for s in others]
            if o.status in _ACTION + _HANDLED and not any(s.status in _ACTION for s in others):
                e.category = FIXED
                e.why = (f"was {o.status}; {moved or f'`{qualname}` '}now holds only "
                         + ", ".join(f"a {s.status} site (line {s.line})" for s in others))
            else:
                e.category = REPLACED
                e.why = f"was {o.status}; {moved or f'`{qualname}` '}now holds " + ", ".join(
                    f"a {s.status} site (line {s.line})" for s in others)
            out.append(e)
            continue
        info = t.new.info(file, qualname)
        if info is not None and info.casts:
            e.category = UNMATCHED
            e.function = info
            e.action = True
            e.why = (f"was {o.status}; {moved or f'`{qualname}` '}still "
                     f"{'reads a KV buffer and ' if info.reads_kv_buffer else ''}casts ({len(info.casts)} cast "
                     f"call(s), first at line {info.casts[0][0]}) but no rule finds a site: check by hand")
            e.action_why = "no rule matches it any more, and the function still casts: check by hand"
        else:
            e.category = FIXED if o.status in _ACTION + _HANDLED else REPLACED
            e.why = (f"was {o.status}; {moved or f'`{qualname}` is still there and '}casts nothing"
                     + (" (it still reads the KV buffer)" if info is not None and info.reads_kv_buffer else ""))
        out.append(e)
    return _order(out, SITE_CATEGORIES)


def compare_plans(old_plans: List, new_plans: List, t: Trees) -> List[Entry]:
    pairs, only_old, only_new = _pair(old_plans, new_plans, _plan_tiers(t))
    out: List[Entry] = []
    for o, n in pairs:
        same = _same(o, n)
        e = Entry(UNCHANGED if same and o.line == n.line and not _relocated(o, n) else MOVED if same else CHANGED,
                  o, n, statement_changed=not same)
        e.why = "same call" if same else "call changed" + (
            f" (receiver `{o.receiver}` -> `{n.receiver}`)" if o.receiver != n.receiver else "") + (
            f" (form {o.form} -> {n.form})" if o.form != n.form else "")
        if _relocated(o, n):
            e.why += f"; {_relocated(o, n)}"
        if o.status != n.status:
            e.why += f"; status {o.status} -> {n.status}"
        if n.status == PLAN_UNSUPPORTED and o.status != PLAN_UNSUPPORTED:
            e.action = True
            e.why += f": {_one(n.reason)}"
            e.action_why = f"plan call now unsupported: {_one(n.reason)}"
        out.append(e)
    for n in only_new:
        e = Entry(NEW, None, n, statement_changed=True, why=_one(n.reason))
        e.action = n.status == PLAN_UNSUPPORTED
        e.action_why = f"new unsupported plan call: {_one(n.reason)}"
        out.append(e)
    new_by_fn = _by_function(new_plans)
    for o in only_old:
        e = Entry(REMOVED, o, None, statement_changed=True)
        if not t.new.present(o.file, o.qualname):
            e.why = f"`{o.qualname}` is gone" + (" (the file is gone)" if not t.new.file_exists(o.file) else "")
        elif new_by_fn.get((o.file, o.qualname)):
            e.category = REPLACED
            e.replaced_by = [p.key for p in new_by_fn[(o.file, o.qualname)]]
            e.why = f"`{o.qualname}` now makes other plan calls"
        else:
            info = t.new.info(o.file, o.qualname)
            if info is not None and info.plan_calls:
                e.category, e.function, e.action = UNMATCHED, info, True
                e.why = (f"`{o.qualname}` still calls plan() ({info.plan_calls} call(s)) but none is recognised "
                         f"as a FlashInfer MLA plan: check by hand")
                e.action_why = "no plan call recognised any more, and the function still calls plan(): check by hand"
            else:
                e.why = f"the plan call is gone; `{o.qualname}` is still there"
        out.append(e)
    return _order(out, PLAN_CATEGORIES)


def _order(entries: List[Entry], cats: Sequence[str]) -> List[Entry]:
    rank = {c: i for i, c in enumerate(cats)}
    return sorted(entries, key=lambda e: (rank.get(e.category, 99), e.rec.file,
                                          e.new.line if e.new is not None else e.old.line))


