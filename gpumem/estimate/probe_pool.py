"""``gpumem fit``'s replays on several processes, asked ahead of the search (Note [Probes replayed ahead]).

Note [Probes replayed ahead]
    A search of :func:`~gpumem.estimate.fit.find_max_batch` asks one size at a time, and each answer near the
    limit is a replay of the whole ``generate()`` (7B, prompt 2048, 4,000 new tokens: seven replays of about a
    second; at the batches it probes nearly every op is sent: Note [Small pool skipped at a fixed point]). The
    search is a function of its answers, and each answer of a size under a limit is a function of the size and
    the limit alone: replayed, shared (Note [Probes share replays]) or bounded by the live bytes, it is the
    same. So the sizes the search may ask next can be replayed before it asks, on other processes. Before each
    replay the search waits for, :func:`ahead` runs the search *dry* over the answers known so far (those of
    replays ended but not yet asked for among them) plus assumed ones (each unknown answer taken both ways,
    breadth first), and collects the sizes those runs would replay next, up to one per idle worker; those are
    replayed at once on a :class:`ProbePool`. The real search then asks what it always asked, in the same order,
    and takes each answer when its replay ends: the result, the tries and every figure are those of the search
    in one process (compared in ``tests/estimate/test_probe_pool.py``). What was replayed ahead and not asked is
    dropped.

    Only a ``generate()`` probe on a device spec the search opens anew for each probe (Note [Each probe on a
    device of its own]) goes to the pool: a process replays it on a device of its own exactly as the search
    would. A shared device (faults, tenants, a Device given) and training steps stay in one process. The pool
    starts with the first replay where the decode is long (:data:`EAGER_STEP_LAYERS`), else once a replay
    took :data:`POOL_AFTER_S` or more: below that, starting processes (half a second to a second and a half)
    costs more than it saves (the tests' small models; a 7B at 1,000 new tokens, whose replays take a quarter
    to half a second: on the H200's host, started after half a second, the pool made that fit 1 s slower).
    Workers start by ``forkserver`` where the platform has it (no fork of a process that may hold other threads'
    locks), else ``spawn``; they are ended, not awaited, when the search ends, so a replay asked ahead and not
    needed costs no wait, and each ends by itself once the search's process is gone.
"""

from __future__ import annotations

import concurrent.futures
import importlib.machinery
import logging
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import numbers
import os
import pickle
import sys
import threading
from collections import deque
from typing import Any, Callable, Hashable

from ..errors import InvalidArgumentError

__all__ = ["ProbePool", "PoolBroken", "POOL_AFTER_S", "EAGER_STEP_LAYERS", "GUARD_HINT", "ahead",
           "check_jobs", "check_not_bootstrapping", "default_jobs", "pool_refused", "usable_cpus"]

log = logging.getLogger(__name__)

POOL_AFTER_S = 1.0
"""A replay at least this long (seconds, in the search's own process) starts the pool (Note [Probes replayed
ahead])."""

EAGER_STEP_LAYERS = 64_000
"""Decode steps times decoder blocks from which a ``generate()`` replay is taken as long before any has run (7B:
2,000 new tokens), so that the pool starts with the first replay (Note [Probes replayed ahead])."""

MAX_JOBS = 8
"""The most worker processes :func:`default_jobs` chooses."""


def usable_cpus(cpu_max_path: str = "/sys/fs/cgroup/cpu.max") -> int:
    """The CPUs this process may run on: its affinity, within its cgroup's CPU quota where one is set (a container
    given ``--cpus 2`` on a 64-CPU host has 64 in its affinity; attacker 2026-12-03). Only a cgroup v2 quota seen
    at the root of the process's own cgroup view (a container's) is read; v1 quotas and those of an ancestor
    group are not."""
    try:
        n = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        n = max(1, os.cpu_count() or 1)
    try:
        with open(cpu_max_path, encoding="ascii") as f:
            quota, period = f.read().split()[:2]
        if quota != "max" and int(period) > 0:
            n = min(n, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):  # no cgroup v2 quota here
        pass
    return n


def default_jobs() -> int:
    """The processes ``gpumem fit`` replays on by default: the CPUs this process may run on, at most
    :data:`MAX_JOBS`."""
    return min(MAX_JOBS, usable_cpus())


def check_jobs(jobs: Any) -> int:
    """``jobs`` as a whole number of processes >= 1 (an ``int``; numpy's integers taken), else
    :class:`InvalidArgumentError`."""
    if isinstance(jobs, bool) or not isinstance(jobs, numbers.Integral) or jobs < 1:
        raise InvalidArgumentError(f"jobs must be a whole number of processes >= 1, got {jobs!r:.60}")
    return int(jobs)


def _run(job: Any) -> Any:
    """A worker's task: the job's ``run()`` (a :class:`~gpumem.estimate.fit.ProbeJob`)."""
    return job.run()


def _watch_parent() -> None:
    """A worker's initializer: end this worker once the process that asked for it (the search's) is gone, as its
    sentinel says (ready at its death, a zombie's too; no pid to be reused). Under ``forkserver`` the worker's
    parent in the process tree is the forkserver, so a search killed (SIGTERM, SIGKILL, the out-of-memory
    killer) before :meth:`ProbePool.close` ran left its workers behind (new user 2026-12-03)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="gpumem-fit-watch-parent", daemon=True).start()


GUARD_HINT = ("a script that calls find_max_batch or replay_inference with jobs=N runs its top level again in each "
              "worker: its calls must be under `if __name__ == \"__main__\":`, as multiprocessing asks")


def pool_refused(job: Any) -> str:
    """Why no worker process can take ``job`` here ('' where they can): this process is a daemon (a worker of
    another pool may not start processes), the main program has no file a worker could import (read from
    stdin), or the job does not pickle."""
    if multiprocessing.current_process().daemon:
        return "this process is a daemon (a pool's worker), which may not start processes"
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if getattr(main, "__spec__", None) is None and isinstance(path, str) and not os.path.isfile(path):
        return f"the main program has no file a worker could import ({path})"
    try:
        pickle.dumps(job)
    except Exception as exc:  # noqa: BLE001 - a local class, a lambda: anything a worker cannot receive
        return f"the replay cannot be sent to a worker ({type(exc).__name__}: {exc})"
    return ""


def check_not_bootstrapping(caller: str = "find_max_batch") -> None:
    """Raise where a worker is importing the main program and that program calls ``caller`` at its top level (it
    would run the whole search or estimate in the worker): the worker ends at once, and the caller's process goes on
    without it."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise InvalidArgumentError(f"{caller} was called while a worker process was starting: " + GUARD_HINT)


PACKAGE_DIR = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
"""The folder this process imported gpumem from."""


def _another_copy_on(path: "list[str]") -> bool:
    """Whether the first package of this name that ``path`` holds (an import hook aside) is not this copy: a folder
    or module elsewhere, a namespace package. False where ``path`` holds none (an import hook finds it)."""
    spec = importlib.machinery.PathFinder.find_spec(__name__.split(".")[0], path)
    if spec is None:
        return False
    found = list(spec.submodule_search_locations or ()) or [os.path.dirname(spec.origin or "")]
    return any(os.path.realpath(f) != PACKAGE_DIR for f in found)


def _shadowed(cwd: "str | None" = None) -> bool:
    """Whether what the working directory (``cwd``, default the current one) holds under this package's name (a
    folder, a ``gpumem.py``) is not this package: the forkserver runs with that directory first on its path
    (``python -c``; CPython 3.11 ignores the path it is given while importing the preload list), so it imported that
    folder as a namespace package (under an editable install) or ran the program's own ``gpumem.py``, and every worker
    failed (new user and attacker 2026-12-03, run from the folder holding a clone)."""
    try:
        return _another_copy_on([cwd if cwd is not None else os.getcwd()])
    except (OSError, ImportError, ValueError):  # the working directory was removed, or cannot be read
        return False


def _forkserver_path() -> "list[str]":
    """Where a ``python -c`` started now looks first for a package: this directory, ``PYTHONPATH``, the site
    folders (an import hook, an editable install's finder, comes after these, in the forkserver as here)."""
    import site

    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    user = site.getusersitepackages() if site.ENABLE_USER_SITE else None
    return [os.getcwd(), *extra, *site.getsitepackages(), *([user] if isinstance(user, str) else [])]


def _other_copy_first() -> bool:
    """Whether the forkserver would import another copy of this package than this process did (a script run from a
    clone, or ``sys.path`` changed by the program, with the package installed too: attacker 2026-12-03, other
    figures on the workers). Each worker then imports it on the program's own path instead."""
    try:
        return _another_copy_on(_forkserver_path())
    except (OSError, ImportError, ValueError):
        return True


def _context() -> Any:
    methods = multiprocessing.get_all_start_methods()
    if "forkserver" in methods:
        ctx = multiprocessing.get_context("forkserver")
        # each worker forks with these imported; a preload list set by the program is kept
        have = [m for m in getattr(getattr(multiprocessing.forkserver, "_forkserver", None), "_preload_modules", ())
                or () if m != "__main__"]  # CPython's default, not the program's choice: never the script here
        ours = ([] if _shadowed() or _other_copy_first() else
                [m for m in (__name__, "gpumem.estimate.fit") if m not in have])
        ctx.set_forkserver_preload(have + ours)  # shadowed: each worker imports them on the program's own path
        return ctx
    return multiprocessing.get_context("spawn")


class ProbePool:
    """Runs jobs (each a picklable object with a ``run()``: :class:`~gpumem.estimate.fit.ProbeJob`) on ``jobs`` worker
    processes, each key at most once (Note [Probes replayed
    ahead])."""

    def __init__(self, jobs: int) -> None:
        self.jobs = check_jobs(jobs)
        self._executor = concurrent.futures.ProcessPoolExecutor(max_workers=self.jobs, mp_context=_context(),
                                                                initializer=_watch_parent)
        self._futures: dict[Hashable, concurrent.futures.Future] = {}
        self.submitted = 0
        """Replays asked for (ahead or waited for)."""
        self.taken = 0
        """Replays whose answer the search took; the rest were asked ahead and not needed."""

    def pending(self, key: Hashable) -> bool:
        """Whether ``key`` was submitted and its result not yet taken."""
        return key in self._futures

    def in_flight(self) -> int:
        """Submitted replays not yet ended."""
        return sum(not f.done() for f in self._futures.values())

    def answers(self) -> "dict[Hashable, bool]":
        """Whether each replay that has ended (and not been taken) fits: known answers for :func:`ahead`."""
        return {k: f.result().fits for k, f in self._futures.items() if f.done() and f.exception() is None}

    def submit(self, key: Hashable, job: Any) -> None:
        """Ask for ``key``'s replay (nothing where it was asked); :class:`PoolBroken` where the pool cannot take it."""
        if key not in self._futures:
            try:
                self._futures[key] = self._executor.submit(_run, job)
            except Exception as exc:  # noqa: BLE001 - broken (a worker died), or a process could not start
                log.warning("find_max_batch: no worker process takes the replay (%s: %s); the search goes on in "
                            "this process alone, with the same answer", type(exc).__name__, exc)
                raise PoolBroken from exc
            self.submitted += 1

    def take(self, key: Hashable, job: Any) -> Any:
        """The result of ``key``'s replay (submitted now if it was not), waiting for it. A pool whose worker died
        (killed, out of host memory) is refused further work: the replay is made here, in this process."""
        self.submit(key, job)
        fut = self._futures.pop(key)
        try:
            r = fut.result()
        except concurrent.futures.process.BrokenProcessPool as exc:
            main_file = getattr(sys.modules.get("__main__"), "__file__", None)
            log.warning("find_max_batch: a worker process ended before its replay did (%s); the search goes on in "
                        "this process alone, with the same answer.%s", exc,
                        f" If this program is a script: {GUARD_HINT}" if main_file else "")
            raise PoolBroken from exc
        except Exception as exc:  # noqa: BLE001 - the replay failed there: made here, which raises if it fails too
            log.info("find_max_batch: a replay failed in a worker (%s: %s); the search goes on in this process",
                     type(exc).__name__, exc)
            raise PoolBroken from exc
        self.taken += 1
        return r

    def close(self) -> None:
        """End the workers now: replays asked ahead and not taken are dropped, not awaited."""
        log.info("find_max_batch: %d replays on %d processes, %d of them asked ahead and not needed",
                 self.submitted, self.jobs, self.submitted - self.taken)
        self._futures.clear()
        ex = self._executor
        terminate = getattr(ex, "terminate_workers", None)  # Python 3.14
        if terminate is not None:
            terminate()
            return
        procs = list((getattr(ex, "_processes", None) or {}).values())
        ex.shutdown(wait=False, cancel_futures=True)
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)


class PoolBroken(Exception):
    """A :class:`ProbePool`'s worker died: the caller replays in its own process from then on."""


def ahead(first: Hashable, first_unknown: Callable[[dict], "Hashable | None"], width: int,
          skip: Callable[[Hashable], bool], known: "dict[Hashable, bool] | None" = None,
          max_runs: int = 64) -> list[Hashable]:
    """The keys to replay now: ``first`` (the one the search waits for) and those the search would ask next under
    every combination of the unknown answers (breadth first), at most ``width`` in all, leaving out those for
    which ``skip`` is True (already asked); ``first`` comes first unless skipped. ``first_unknown(assumed)``
    runs the search dry with the answers in ``assumed`` (key -> bool) taken as given and returns the first key
    it would have to replay, or None when the search ends without another replay. ``known``: answers of
    replays that have ended, taken as given in every dry run (``first``'s among them when it has ended). At most
    ``max_runs`` dry runs."""
    known = dict(known or {})
    keys = [] if skip(first) else [first]
    seen = {first}
    queue: deque[dict] = deque([known] if first in known else [{**known, first: True}, {**known, first: False}])
    runs = 0
    while queue and len(keys) < width and runs < max_runs:
        assumed = queue.popleft()
        runs += 1
        key = first_unknown(assumed)
        if key is None:
            continue
        if key not in seen:
            seen.add(key)
            if not skip(key):
                keys.append(key)
        queue.append({**assumed, key: True})
        queue.append({**assumed, key: False})
    return keys
