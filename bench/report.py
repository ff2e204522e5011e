"""Ratios of agentloop's figures against the baseline measured in the same run, and the targets.

Usage: report.py results.jsonl [peers RESULTS.md]. Peer figures come from this run when the peers
were measured (``run.sh --peers``), else from the harness's recorded RESULTS.md (noted as such).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PEERS = ["openai-agents", "pydantic-ai", "langgraph create_react_agent", "langchain create_agent", "smolagents"]


def load(path: str) -> dict[tuple[str, str], dict[str, float]]:
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip().startswith("{"):
            row = json.loads(line)
            rows[(row["framework"], row["workload"])] = row
    return rows


def recorded_peer_w1(results_md: str) -> dict[str, float]:
    """W1 µs/run of each peer from the first table of the harness's RESULTS.md."""
    out: dict[str, float] = {}
    for line in Path(results_md).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) > 2 and cells[0] in PEERS and cells[0] not in out:
            out[cells[0]] = float(re.sub(r"[^\d.]", "", cells[1]))
    return out


def main() -> None:
    rows = load(sys.argv[1])
    base, ours = "baseline", "ours"
    w1 = rows.get((ours, "W1"))
    b1 = rows.get((base, "W1"))
    print("## agentloop vs targets (issue: the engine)\n")
    print("| figure | agentloop | baseline (same run) | ratio | target | met |")
    print("|---|---:|---:|---:|---|:-:|")
    if w1 and b1:
        for key, label in (
            ("p50_us", "W1 p50 µs/run"),
            ("cpu_us_per_run", "W1 CPU µs/run"),
            ("best_block_us_per_run", "W1 best-block µs/run"),
        ):
            r = w1[key] / b1[key]
            print(
                f"| {label} | {w1[key]:.1f} | {b1[key]:.1f} | {r:.1f}× | ≤ 5× baseline | {'yes' if r <= 5 else 'no'} |"
            )
    peer_w1 = {p: rows[(p, "W1")]["us_per_run"] for p in PEERS if (p, "W1") in rows}
    source = "this run"
    if not peer_w1 and len(sys.argv) > 2:
        peer_w1, source = recorded_peer_w1(sys.argv[2]), "recorded RESULTS.md"
    if w1 and peer_w1:
        fastest = min(peer_w1, key=peer_w1.__getitem__)
        r = peer_w1[fastest] / w1["us_per_run"]
        print(
            f"| W1 vs fastest peer ({fastest}, {source}) | {w1['us_per_run']:.1f} µs | "
            f"{peer_w1[fastest]:,.0f} µs | {r:.0f}× faster | ≥ 40× faster | {'yes' if r >= 40 else 'no'} |"
        )
    w2 = rows.get((ours, "W2"))
    if w2:
        p = w2["tool_parallelism"]
        print(
            f"| W2 tool parallelism (of 8) | {p} | {rows.get((base, 'W2'), {}).get('tool_parallelism', '-')} | "
            f"- | ≥ 7.5 | {'yes' if p >= 7.5 else 'no'} |"
        )
    w3, b3 = rows.get((ours, "W3")), rows.get((base, "W3"))
    if w3:
        bv = f"{b3['us_per_model_call']:.1f}" if b3 else "-"
        print(f"| W3 µs/model call (201 calls) | {w3['us_per_model_call']:.1f} | {bv} | - | flat (see below) | - |")
    w4 = rows.get((ours, "W4"))
    if w4:
        b4 = rows.get((base, "W4"), {}).get("wall_ms", "-")
        print(
            f"| W4 wall ms, 1000 sessions | {w4['wall_ms']:.0f} | {b4} | - | ≤ 500 ms | "
            f"{'yes' if w4['wall_ms'] <= 500 else 'no'} |"
        )
    durable(rows, peer_w1, source)


def durable(rows: dict[tuple[str, str], dict[str, float]], peer_w1: dict[str, float], source: str) -> None:
    ours, base = "ours-sqlite", "baseline-sqlite"
    w1, b1 = rows.get((ours, "W1")), rows.get((base, "W1"))
    if not w1:
        return
    print("\n## agentloop durable (SQLite) vs targets (issue: durable processes)\n")
    print("| figure | agentloop durable | baseline-sqlite (same run) | ratio | target | met |")
    print("|---|---:|---:|---:|---|:-:|")
    if b1:
        for key, label in (("p50_us", "W1 p50 µs/run"), ("cpu_us_per_run", "W1 CPU µs/run")):
            r = w1[key] / b1[key]
            met = "yes" if r <= 1.5 else "no"
            print(f"| {label} | {w1[key]:.0f} | {b1[key]:.0f} | {r:.1f}× | ≤ 1.5× baseline-sqlite | {met} |")
    if peer_w1:
        fastest = min(peer_w1, key=peer_w1.__getitem__)
        r = peer_w1[fastest] / w1["us_per_run"]
        print(
            f"| W1 vs fastest peer in memory ({fastest}, {source}) | {w1['us_per_run']:.0f} µs | "
            f"{peer_w1[fastest]:,.0f} µs | {r:.1f}× faster | ≥ 10× faster | {'yes' if r >= 10 else 'no'} |"
        )
    w3 = rows.get((ours, "W3"))
    if w3:
        print(
            f"| W3 µs/model call (201 calls) | {w3['us_per_model_call']:.0f} | "
            f"{rows.get((base, 'W3'), {}).get('us_per_model_call', '-')} | - | flat | - |"
        )
    w4 = rows.get((ours, "W4"))
    if w4:
        print(
            f"| W4 wall ms, 1000 durable sessions | {w4['wall_ms']:.0f} | "
            f"{rows.get((base, 'W4'), {}).get('wall_ms', '-')} | - | ≤ 1500 ms | "
            f"{'yes' if w4['wall_ms'] <= 1500 else 'no'} |"
        )


if __name__ == "__main__":
    main()
