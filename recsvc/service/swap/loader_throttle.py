"""A background thread that loads a new bundle version (``bundle_watch.BundleWatch``) without slowing the requests
served meanwhile: while calls are being answered, it runs in short slices and sleeps between them.

Why: loading (tokenizer, model construction, the tables) and warming up are Python code that holds the GIL,
and the serving thread needs the GIL back after each of its many short torch operations (each releases it). A
loader that runs freely takes about half of the GIL's time from the serving thread and makes it wait for every
operation: requests decoded during a swap took 2.2-3.3x as long at p99 on an idle 2-core machine. Lowering the
loader thread's CPU priority (nice) does not help: a deprioritised thread that holds the GIL when it is
preempted stalls the serving thread (a priority inversion).

:class:`LoaderThrottle`, entered in the loading thread, installs a profile function in that thread only
(``sys.setprofile``: called at each Python and C function call and return). Every ``CHECK_EVERY`` events it
looks at the clock: once ``run_s`` has passed since it last yielded and ``busy()`` says calls are being answered
(``recsvc.service.swap.call_activity``: the whole call, and a moment after it, not only its decoding), it sleeps
(the GIL and the core are the serving thread's meanwhile) ``pause_s``, or ``pause_s / run_s``
times the CPU time it used since it last yielded (``time.thread_time``) when that is longer, at most
``MAX_PAUSE_S``: a long C call (a sort, a tensor op) is followed by a long sleep, so the loader's share of the CPU
stays about ``run_s / (run_s + pause_s)``, and a loader that waited for the GIL or a core (a busy machine) still
yields every ``run_s``. When no call is being answered, the loader runs at full speed. The load gets slower under
load (by ``(run_s + pause_s) / run_s`` or more, plus the profile function's own cost), never the requests: a
warm-up need not be fast, only done before the switch. A single C call that holds the GIL (a large JSON file
parsed: 20-25 ms for a 12k-item catalog's semantic ids on a busy 2-core machine) is not cut: the loading code
keeps its calls short (the trie's 46 MB table is filled 64 rows per call, the popularity order is one C sort).

    >>> with LoaderThrottle(lambda: True, run_s=0.0, pause_s=0.0) as throttle:
    ...     _ = sorted(str(i) for i in range(1000))
    >>> throttle.pauses > 0
    True
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

RUN_S = 0.0005  # the longest the loader runs at a time while calls are being answered ...
PAUSE_S = 0.0045  # ... then it sleeps this long (or 9x the CPU it used): about 1/10 of the CPU is the loader's
MAX_PAUSE_S = 0.25  # the longest sleep (after a long C call)
CHECK_EVERY = 32  # profile events between two looks at the clock (one event: ~0.1-1 us of work)


class LoaderThrottle:
    """``with LoaderThrottle(busy):`` around the loading code, in the loading thread (not re-entrant)."""

    def __init__(self, busy: Callable[[], bool], run_s: float = RUN_S, pause_s: float = PAUSE_S,
                 check_every: int = CHECK_EVERY, max_pause_s: float = MAX_PAUSE_S) -> None:
        self.busy, self.run_s, self.pause_s, self.check_every = busy, run_s, pause_s, check_every
        self.max_pause_s = max_pause_s
        self.pauses = 0  # sleeps taken
        self.paused_s = 0.0  # time slept
        self.longest_s = 0.0  # the most CPU time the loader used between two yields while requests were decoded
        self._previous: Any = None

    def stats(self) -> dict[str, float]:
        """What it did, for the swap's log line: pauses, seconds paused, the most CPU between yields (ms)."""
        return {"pauses": self.pauses, "paused_s": round(self.paused_s, 3),
                "longest_slice_cpu_ms": round(self.longest_s * 1e3, 2)}

    def __enter__(self) -> LoaderThrottle:
        cpu, clock, sleep, busy = time.thread_time, time.perf_counter, time.sleep, self.busy
        run_s, check_every, max_pause_s = self.run_s, self.check_every, self.max_pause_s
        per_run = self.pause_s / run_s if run_s > 0 else 0.0  # seconds slept per second run
        floor = self.pause_s  # the sleep after a slice that used run_s of CPU or less
        countdown = check_every
        since, since_cpu = clock(), cpu()

        def hook(_frame: FrameType, _event: str, _arg: object) -> None:
            nonlocal countdown, since, since_cpu
            countdown -= 1
            if countdown:
                return
            countdown = check_every
            if clock() - since < run_s:
                return
            if busy():
                used = cpu() - since_cpu
                self.longest_s = max(self.longest_s, used)
                slept = clock()
                sleep(min(max(used * per_run, floor), max_pause_s))
                self.pauses += 1
                self.paused_s += clock() - slept
            since, since_cpu = clock(), cpu()

        self._previous = sys.getprofile()
        sys.setprofile(hook)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        sys.setprofile(self._previous)
