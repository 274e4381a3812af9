"""``gpumem estimate``'s policies replayed side by side on worker processes (Note [Policies replayed apart]).

Note [Policies replayed apart]
    An estimate replays ``generate()`` under each policy it names (``pytorch``, ``expandable``, ``gpumem`` by
    default), each on a device of its own and each stopping on its own (Note [One stream, every policy] in
    :mod:`.fastreplay`): its figure depends on its policy and the workload alone. So a group of policies can be
    replayed in another process and give the figures this one would. On a long decode the replays are the
    estimate's time (7B, prompt 2,048, 4,000 new tokens: ``gpumem`` 0.9 s, the two others 0.5 s of CPU; 16,000:
    4.1 and 2.3 s), so with :data:`APART_STEP_LAYERS` or more new tokens times blocks and more than one
    process allowed, each group but the first runs on a process of its own, started first, while this process
    replays the first group: the policy whose decode sends every op (``gpumem``), as it takes longest and a
    worker starts a quarter to half a second late. The figures are those of one process
    (``tests/estimate/test_policy_workers.py``); what goes wrong with a worker (it cannot start, it died, its
    replay failed there) leaves its group to this process, which replays it itself (and raises what it raises).
    A worker refuses a policy or a device profile changed at run time in this process (it has the program's as
    imported) and a job from a process that imported another copy of gpumem (the forkserver preloads the package
    only where its own path finds this copy); other module constants changed at run time (the workload's) are not
    seen there. What refuses a policy on the device (no virtual memory) raises here before any worker starts.
    Each worker counts its decode steps in shared memory, which this process adds to the caller's bar; where a
    policy stops early (out of memory) its group stops counting, where one process counts every policy while any
    runs, so the bar can end short of one process's there. Workers start by ``forkserver`` (as
    :mod:`.probe_pool`'s), end by themselves once this process is gone, and are ended (killed, if they ignore
    SIGTERM) when the estimate ends. A script's top level runs again in each worker as it starts: one not under
    ``if __name__ == "__main__":`` fails the worker, after running whatever else that top level runs.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import sys
import threading
from dataclasses import dataclass
from typing import Any

from .probe_pool import GUARD_HINT, _context, _watch_parent, check_jobs, pool_refused

__all__ = ["APART_STEP_LAYERS", "PolicyWorkers", "split_policies"]

log = logging.getLogger(__name__)

APART_STEP_LAYERS = 96_000
"""New tokens times decoder blocks from which the estimate's policies are replayed apart (7B: 3,000 new tokens;
Note [Policies replayed apart]). At 2,000 new tokens of a 7B, 2 CPUs, starting a worker cost about what it saved
(0.84-0.92 s against 0.75-0.92 s; a reviewer on a busy machine 1.11 s against 1.43 s: reports/estimate-speed.md
round 15); at 4,000 it saved a third."""

POLL_S = 0.1
"""How often the bar is moved while this process waits for a worker."""


def split_policies(policies: "tuple[str, ...]", jobs: int) -> "list[tuple[int, ...]]":
    """The positions of ``policies`` in ``min(jobs, len(policies))`` groups, this process's first: it keeps
    ``gpumem`` (the longest decode) where named, else the first policy; the others are dealt to the workers in
    turn."""
    check_jobs(jobs)
    n = min(jobs, len(policies))
    first = policies.index("gpumem") if "gpumem" in policies else 0
    rest = [k for k in range(len(policies)) if k != first]
    groups: list[list[int]] = [[first]] + [[] for _ in range(n - 1)]
    for i, k in enumerate(rest):
        groups[1 + i % (n - 1) if n > 1 else 0].append(k)
    return [tuple(g) for g in groups]


class _CounterBar:
    """A worker's progress bar: the steps it replayed, counted where the estimate's process reads them."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter

    def update(self, n: float = 1) -> None:
        self._counter.value += int(n)

    def close(self) -> None:
        """Nothing to close."""


def _work(job: Any, conn: Any, counter: Any) -> None:
    """A worker: ``job.run(bar)``'s result sent back, or why it failed (the estimate's process then replays the
    group itself)."""
    _watch_parent()
    try:
        out: tuple[str, Any] = ("ok", job.run(_CounterBar(counter)))
    except BaseException as exc:  # noqa: BLE001 - anything: the caller's own replay raises it again
        out = ("failed", f"{type(exc).__name__}: {exc}")
    try:
        try:
            conn.send(out)
        except Exception as exc:  # noqa: BLE001 - a result that does not pickle: the caller replays
            conn.send(("failed", f"the result could not be sent ({type(exc).__name__}: {exc})"))
    except OSError:  # the caller has gone or stopped listening (it ended this worker's estimate): nothing to say
        pass
    finally:
        conn.close()


@dataclass
class _Worker:
    job: Any
    conn: Any = None
    counter: Any = None
    process: Any = None
    starter: "threading.Thread | None" = None
    start_error: str = ""
    refused: str = ""
    """Why no worker may start here by design (a daemon process, a program read from stdin, a job that does not
    pickle): said once, at INFO."""
    counted: int = 0
    """Steps of this worker already added to the bar."""


class PolicyWorkers:
    """One worker process per job (a picklable object whose ``run(bar)`` returns the group's figures), started at
    once (Note [Policies replayed apart]). :meth:`result` gives a job's figures, or None where this process must
    replay the group itself; :meth:`close` ends every worker."""

    def __init__(self, jobs: "list[Any]", bar: Any) -> None:
        self._bar = bar
        self._workers = [_Worker(job) for job in jobs]
        self._said_refused = False
        try:
            self._start_all()
        except BaseException:
            self.close()
            raise

    def _start_all(self) -> None:
        try:
            ctx = _context()
        except Exception as exc:  # noqa: BLE001 - no start method works here: this process replays every group
            ctx, why = None, f"{type(exc).__name__}: {exc}"
        for w in self._workers:
            if ctx is None:
                w.start_error = why
                continue
            w.refused = pool_refused(w.job)
            if w.refused:
                continue
            try:
                receive, send = ctx.Pipe(duplex=False)
                w.conn, w.counter = receive, ctx.RawValue("q", 0)
                w.process = ctx.Process(target=_work, args=(w.job, send, w.counter), daemon=True,
                                        name="gpumem-estimate-policies")
            except Exception as exc:  # noqa: BLE001 - no semaphores, no pipes: this process replays it
                w.start_error = f"{type(exc).__name__}: {exc}"
                continue
            # started on a thread: the first start waits for the forkserver's imports, which this process need not
            starter = threading.Thread(target=self._start, args=(w, send), name="gpumem-estimate-start", daemon=True)
            try:
                starter.start()
            except RuntimeError as exc:  # "can't start new thread" (a pids limit): this process replays it
                w.start_error = f"{type(exc).__name__}: {exc}"
                send.close()
                continue
            w.starter = starter

    @staticmethod
    def _start(w: _Worker, send: Any) -> None:
        try:
            w.process.start()
        except Exception as exc:  # noqa: BLE001 - no process could start here
            w.start_error = f"{type(exc).__name__}: {exc}"
        finally:
            send.close()  # the worker holds its own end; a worker that dies shows as the end of this pipe

    def progress(self) -> int:
        """The workers' steps not yet added to the bar (adds nothing)."""
        return sum(self._fresh(w, peek=True) for w in self._workers)

    def _fresh(self, w: _Worker, peek: bool = False) -> int:
        if w.counter is None:
            return 0
        n = w.counter.value - w.counted
        if not peek:
            w.counted += n
        return n

    def bar(self) -> Any:
        """A bar for this process's own replay that also moves by the workers' steps."""
        return _MergedBar(self._bar, self)

    def move_bar(self) -> None:
        """Add the workers' new steps to the bar."""
        n = sum(self._fresh(w) for w in self._workers)
        if n:
            self._bar.update(n)

    def result(self, k: int) -> Any:
        """Job ``k``'s figures, waiting for them (the bar moving meanwhile); None where the worker could not give
        them (logged), and the steps it counted are taken off the bar's next updates for this process's replay:
        :meth:`replay_bar`."""
        w = self._workers[k]
        if w.refused:
            if not self._said_refused:
                self._said_refused = True
                log.info("replay_inference: no worker process here (%s): the policies are replayed in this process",
                         w.refused)
            return None
        if w.starter is not None:
            while w.starter.is_alive():
                w.starter.join(POLL_S)
                self.move_bar()
        why = w.start_error
        if not why:
            try:
                while not w.conn.poll(POLL_S):
                    self.move_bar()
                status, value = w.conn.recv()
            except (EOFError, OSError) as exc:
                status, value = "failed", self._why_ended(w, exc)
            self.move_bar()
            if status == "ok":
                return value
            why = value
        log.warning("replay_inference: the policies of a worker process are replayed in this process instead (%s)",
                    why)
        return None

    @staticmethod
    def _why_ended(w: _Worker, exc: BaseException) -> str:
        """Why a worker's pipe ended with no result: the signal that killed it, else (the program a script) the hint
        that its top level must be guarded, the likeliest cause of a worker that failed as it started."""
        w.process.join(timeout=1)
        code = w.process.exitcode
        if code is not None and code < 0:
            return f"the worker process was killed by signal {-code} before its replay ended"
        main_file = getattr(sys.modules.get("__main__"), "__file__", None)
        return (f"the worker process ended before its replay did ({str(exc) or type(exc).__name__}, exit code {code})"
                + (f". If this program is a script: {GUARD_HINT}" if main_file else ""))

    def replay_bar(self, k: int) -> Any:
        """The bar for replaying job ``k`` here after its worker failed: the steps the worker counted are not
        counted twice."""
        return _SkipBar(self._bar, self._workers[k].counted)

    def close(self) -> None:
        """End every worker now (a replay not taken is dropped, not awaited)."""
        for w in self._workers:
            if w.starter is not None:
                w.starter.join()
            p = w.process
            if p is not None and w.starter is not None and not w.start_error:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=1)
                if p.is_alive():  # SIGTERM handled or ignored (a handler the worker's import of the program set)
                    p.kill()
                p.join(timeout=5)
            if w.conn is not None:
                w.conn.close()


class _MergedBar:
    """The caller's bar, moved by this process's steps and by the workers' new ones."""

    def __init__(self, bar: Any, workers: PolicyWorkers) -> None:
        self._bar = bar
        self._workers = workers

    def update(self, n: float = 1) -> None:
        self._bar.update(n)
        self._workers.move_bar()

    def close(self) -> None:
        """The caller closes its bar."""


class _SkipBar:
    """The caller's bar, not moved by the first ``skip`` steps (counted already by a worker that then failed)."""

    def __init__(self, bar: Any, skip: int) -> None:
        self._bar = bar
        self._skip = skip

    def update(self, n: float = 1) -> None:
        take = min(self._skip, int(n))
        self._skip -= take
        if n - take:
            self._bar.update(n - take)

    def close(self) -> None:
        """The caller closes its bar."""
