"""The ``echo`` role: a small real worker for tests and the demo.

It serves the control channel, counts ticks, and can be told through its
options (``EchoOptions``) to misbehave the ways real workers do, so the
supervisor's handling of each can be tested against a real process:

    ready_after_s   wait this long before reporting ready (a slow model load)
    crash_after_s   raise RuntimeError after this long (a Python exception)
    exit_after_s    exit with ``exit_code`` after this long
    exit_code       status for exit_after_s (default 0: a clean exit)
    ignore_term     ignore SIGTERM (a stuck worker: the supervisor must SIGKILL)
    freeze_after_s  block the whole process after this long (a hung worker: health probes
                    time out, the supervisor restarts it)
    hog_mib         once ready, fill this many MiB, 16 at a time (a worker that runs out
                    of memory: under a cgroup limit the kernel's OOM killer ends it)
    busy            report having work: its progress (each tick a step) in its health
                    answer says busy, so the supervisor's watchdog watches it
    stall_after_s   stop ticking after this long while the control channel still answers
                    (with ``busy``: alive, with work, no progress; the watchdog restarts it)
    drain_s         once told to stop, go on answering (health: stopping) this long
                    before returning (a stage draining its sequences)
    teardown_s      once its role returned (its control channel closed, its exit record
                    written), take this long to exit (a slow interpreter teardown)
    interval_s      tick period (default 1.0)
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import signal
import time

from mlxceld.roles.options import EchoOptions
from mlxceld.workers.runtime import WorkerContext, progress_report

log = logging.getLogger(__name__)

HOG_STEP_MIB = 16


async def run(ctx: WorkerContext[EchoOptions]) -> int:
    o = ctx.options
    if o.ignore_term:
        asyncio.get_running_loop().remove_signal_handler(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    start = time.monotonic()
    await _sleep_unless_stopped(ctx, o.ready_after_s)
    ctx.ready()
    ctx.stats["ticks"] = 0
    busy_since = time.monotonic() if o.busy else None
    last_tick: float | None = None
    ctx.progress = lambda: progress_report(ctx.stats["ticks"], last_tick, busy_since)
    hog: list[bytearray] = []
    while len(hog) * HOG_STEP_MIB < o.hog_mib and not ctx.stopping.is_set():
        hog.append(bytearray(b"\x01") * (HOG_STEP_MIB << 20))  # written: every page is used
        await asyncio.sleep(0.01)
    while not ctx.stopping.is_set():
        elapsed = time.monotonic() - start
        if o.crash_after_s is not None and elapsed >= o.crash_after_s:
            raise RuntimeError(f"echo worker {ctx.name} crashed on purpose")
        if o.exit_after_s is not None and elapsed >= o.exit_after_s:
            return o.exit_code
        if o.freeze_after_s is not None and elapsed >= o.freeze_after_s:
            time.sleep(3600)  # blocks the event loop: the control channel stops answering
        await _sleep_unless_stopped(ctx, min(o.interval_s, 0.05) if o.timed else o.interval_s)
        if o.stall_after_s is not None and elapsed >= o.stall_after_s:
            continue  # stalled: no more steps, the channel still answers
        ctx.stats["ticks"] += 1
        last_tick = time.monotonic()
    log.info("echo worker %s stopping after %d ticks", ctx.name, ctx.stats["ticks"])
    await asyncio.sleep(o.drain_s)
    if o.teardown_s:
        ctx.skip_teardown = False  # a real teardown, then ...
        atexit.register(time.sleep, o.teardown_s)  # ... this, after the exit record
    return 0


async def _sleep_unless_stopped(ctx: WorkerContext[EchoOptions], seconds: float) -> None:
    if seconds <= 0:
        return
    try:
        async with asyncio.timeout(seconds):
            await ctx.stopping.wait()
    except TimeoutError:
        pass
