"""workers: the processes a tree scan spreads its files over.

Imports nothing heavy (no libcst): the audit command asks `effective_jobs`
before it loads the rules, to decide whether to start its prefetch helper
(prefetch.py), which dies with its parent too.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import signal
import sys
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from typing import Callable, Iterator, List, Optional, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def effective_jobs(jobs: Optional[int]) -> int:
    """Worker processes for `jobs` (None: the engine's own choice, up to 2)."""
    return jobs or min(2, os.cpu_count() or 1)


def _start_worker() -> None:
    # What the fork copied (libcst, the rules, the parent's heap) is never garbage here:
    # frozen, the worker's collections skip it instead of walking, and so copying, its pages.
    gc.freeze()
    die_with_parent()


def die_with_parent() -> None:
    """On Linux the kernel kills this process when its parent dies (kill -9
    included), so no scan outlives the command."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:  # no libc by that name (musl): workers then end with the pool
        pass


def pool(jobs: int) -> ProcessPoolExecutor:
    # Forked on Linux, whatever the Python's default (3.14 made it forkserver): a forked
    # worker has libcst and the rules already imported, which costs ~0.2 s a process anew.
    ctx = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    return ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_start_worker)


def largest_first(executor: Optional[Executor], fn: Callable[..., List[R]], items: List[T],
                  size: Callable[[T], int], *args) -> Iterator[R]:
    """fn([item], *args) for each item, results as they come (fn is module-level: it is
    pickled). In the pool, one task an item, queued largest first: a big file started
    last would leave one worker busy alone at the end (one SGLang backend takes ~20% of
    a whole tree's analysis). Without a pool (None), fn(items, *args) runs here at once."""
    if executor is None:
        yield from (fn(items, *args) if items else [])
        return
    futures = [executor.submit(fn, [item], *args) for item in sorted(items, key=size, reverse=True)]
    for f in as_completed(futures):
        yield from f.result()
