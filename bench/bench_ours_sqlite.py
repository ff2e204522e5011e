"""agentloop's durable runner on the peer harness's workloads, beside ``baseline-sqlite``.

Each run is a new durable process on one SQLite kernel, spawned with the user's message (the
process, the message and the run commit together; the peers' ``run(input)`` likewise takes the
conversation and its first message in one call), then waited on until idle; every later step commits
in its own transaction. See ``bench_ours.make_durable_runner``.
"""

from __future__ import annotations

import common  # type: ignore[import-not-found]  # the harness folder, put on PYTHONPATH by run_all.sh
from bench_ours import make_durable_runner

if __name__ == "__main__":
    common.main(
        "ours-sqlite",
        make_durable_runner,
        caps="no iteration cap; SQLite WAL, synchronous=NORMAL, one transaction per step",
    )
