"""Where a durable run's CPU goes: cProfile over many runs of one workload (default W1) on the
durable runner of ``bench_ours.make_durable_runner``, after a warm-up, with the garbage collector
off while profiling (a collection would be charged to whatever allocated last), in microseconds
per run: own time, cumulative time, calls per run. ``--gc`` leaves the collector on and reports
the time it took per run instead (``gc.callbacks``).

    PYTHONPATH=../shared/bench/peers:bench .venv/bin/python bench/profile_w1.py [W1] [--runs N]
        [--sort tottime|cumtime|calls] [--top N] [--gc]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import pstats
import time
from typing import Any

import common  # type: ignore[import-not-found]  # the harness folder, on PYTHONPATH
from bench_ours import make_durable_runner

_SORT = {"tottime": 0, "cumtime": 1, "calls": 2}


async def _profile(workload: str, runs: int, sort: str, top: int) -> None:
    run = make_durable_runner(common.WORKLOADS[workload])
    for _ in range(50):
        await run()
    gc.collect()
    gc.disable()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(runs):
        await run()
    prof.disable()
    gc.enable()
    rows = []
    stats: dict[Any, Any] = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    for (path, line, name), (_, calls, own, cumulative, _) in stats.items():
        where = path.split("/src/agentloop/")[-1].split("/lib/python3.11/")[-1]
        rows.append((own / runs * 1e6, cumulative / runs * 1e6, calls / runs, f"{where}:{line}({name})"))
    rows.sort(key=lambda r: r[_SORT[sort]], reverse=True)
    print(f"profiled: {sum(r[0] for r in rows):.0f} us/run (cProfile's own overhead included)")
    print(f"{'own us':>8} {'cum us':>9} {'calls':>7}  function")
    for own, cumulative, calls, where in rows[:top]:
        print(f"{own:8.1f} {cumulative:9.1f} {calls:7.1f}  {where[-110:]}")


async def _gc_time(workload: str, runs: int) -> None:
    run = make_durable_runner(common.WORKLOADS[workload])
    for _ in range(50):
        await run()
    gc.collect()
    spent = [0.0]
    started = [0.0]
    counts = [0, 0, 0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent[0] += time.perf_counter() - started[0]
            counts[info["generation"]] += 1

    gc.callbacks.append(timed)
    cpu = time.process_time()
    for _ in range(runs):
        await run()
    cpu = time.process_time() - cpu
    gc.callbacks.remove(timed)
    print(
        f"cpu {cpu / runs * 1e6:.1f} us/run, of which gc {spent[0] / runs * 1e6:.1f} us/run;"
        f" collections by generation {counts}; objects {len(gc.get_objects())}"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", nargs="?", default="W1")
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--sort", choices=sorted(_SORT), default="tottime")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--gc", action="store_true")
    args = parser.parse_args()
    if args.gc:
        asyncio.run(_gc_time(args.workload, args.runs))
    else:
        asyncio.run(_profile(args.workload, args.runs, args.sort, args.top))


if __name__ == "__main__":
    main()
