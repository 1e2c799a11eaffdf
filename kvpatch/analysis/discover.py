"""discover: which files of a tree could hold a site.

A byte-level prefilter over every ``.py`` file. It must never miss a file that
holds a site (every site spells one of the markers below), and it keeps the
expensive parsers away from the ~99% of SGLang that cannot match.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, List, Optional, Tuple, Union

from kvpatch.checkout import repo
from kvpatch.names import CANNOT_READ, CANDIDATE_MARKERS, MLA_PLAN_FUNCTIONS, MLA_WRAPPER, SKIP_DIRS
from kvpatch.checkout.safepath import UnsafePath, is_link, read_regular

# A KV-buffer read, or a site kvpatch already rewrote (plain substrings: `bytes in`
# is ~5x faster than a regex alternation) ...
MARKERS = tuple(m.encode() for m in CANDIDATE_MARKERS)
# ... or an MLA plan call, which only matters in a file using the MLA wrapper.
PLAN = re.compile(rb"\.plan\b|" + "|".join(MLA_PLAN_FUNCTIONS).encode())
_MLA_WRAPPER = MLA_WRAPPER.encode()


def is_candidate(data: bytes) -> bool:
    if any(lit in data for lit in MARKERS):
        return True
    return _MLA_WRAPPER in data and bool(PLAN.search(data))



@dataclass
class SourceFile:
    """A file read once: its path relative to the root and its raw bytes."""

    rel: str
    path: Path
    data: bytes


@dataclass
class ReadError:
    rel: str
    message: str


def iter_python_paths(root: Path, excluded: Optional[Callable[[str], bool]] = None) -> Iterator[Path]:
    """Every ``*.py`` under root, in a stable order, not following dir symlinks;
    in a git checkout, those git lists (an ignored build copy is not scanned).
    `excluded` (config's ``exclude``) drops a path, given relative to root."""
    for path in _python_paths(root):
        if excluded is None or not excluded(rel_path(root, path)):
            yield path


def _python_paths(root: Path) -> Iterator[Path]:
    if root.is_file():
        yield root
        return
    listed = repo.listed_files(root)
    if listed is None:
        yield from _walk(root)
        return
    for rel in listed:
        if SKIP_DIRS.intersection(rel.split("/")[:-1]):
            continue
        path = root / rel
        if rel.endswith(".py"):
            yield path
        elif path.is_dir() and not is_link(path):  # a submodule: git lists it as one entry
            yield from _walk(path)


def _walk(root: Path) -> Iterator[Path]:
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                if e.name not in SKIP_DIRS:
                    subdirs.append(Path(e.path))
            elif e.name.endswith(".py"):
                yield Path(e.path)
        stack.extend(reversed(subdirs))


def rel_path(root: Path, path: Path) -> str:
    if root.is_file():
        return path.name
    return path.relative_to(root).as_posix()


def read_candidate(root: Path, path: Path):
    """Return a SourceFile if the file could hold a site, None if it cannot,
    or a ReadError if it cannot be read."""
    rel = rel_path(root, path)
    if is_link(path):
        # Never read through a link: it can lead out of the checkout (or to /dev/zero).
        return ReadError(rel, "is a symbolic link: skipped (kvpatch does not read or write through links)")
    try:
        data = read_regular(path)  # a FIFO or device named *.py is refused, never opened blocking
    except UnsafePath:
        return ReadError(rel, "not a regular file: skipped")
    except OSError as exc:
        return ReadError(rel, f"{CANNOT_READ}: {exc.strerror or exc}")
    if not is_candidate(data):
        return None
    return SourceFile(rel, path, data)


def read_candidates(root: Path, indexed: Iterable[Tuple[int, Path]]) -> List[Tuple[int, Union[SourceFile, ReadError]]]:
    """read_candidate over (index, path) pairs: the candidates and the read errors, each
    with its path's index (the files that cannot hold a site are left out)."""
    out = []
    for i, path in indexed:
        got = read_candidate(root, path)
        if got is not None:
            out.append((i, got))
    return out


def looks_like_sglang(root: Path) -> Optional[str]:
    """None if root looks like an SGLang checkout (or part of one), else why not."""
    if root.is_file():
        return None
    for probe in ("python/sglang", "sglang", "srt"):
        if (root / probe).is_dir():
            return None
    if (root / "__init__.py").exists() or any(root.glob("*.py")):
        return None
    return ("no python/sglang/ (or sglang/, srt/) directory and no .py files at the top: "
            "expected an SGLang checkout, or a directory inside one")


def chunk(items: List, n: int) -> List[List]:
    """Split into n interleaved chunks, so big and small files spread evenly."""
    return [items[i::n] for i in range(n)] if n > 1 else [items]
