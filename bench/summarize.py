"""Collect bench/results/*.json into one markdown table (bench/results/SUMMARY.md), with the
machine it ran on. Usage: python bench/summarize.py"""

from __future__ import annotations

import json
import os
import platform

from results_dir import results_path


def load(name: str) -> dict:
    path = results_path(name)
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    rows = []
    acquire = load("session_acquire.json")
    for runtime, data in acquire.items():
        warm, cold = data["warm pool"]["median_ms"], data["cold start"]["median_ms"]
        bare = data["bare docker run + ipykernel"]["median_ms"]
        rows.append(
            (
                f"acquire -> 1+1, warm pool ({runtime})",
                f"{warm:.1f} ms",
                f"cold {cold:.0f} ms ({cold / warm:.0f}x), bare docker {bare:.0f} ms",
            )
        )
    roundtrip = load("execute_roundtrip.json").get("results", {})
    raw = roundtrip.get("raw jupyter_client (sandkernel kernel)", {}).get("p50_ms")
    for name in ("sandkernel session API", "sandkernel websocket", "Kernel Gateway 3 websocket (local kernel)"):
        if name in roundtrip and raw:
            p50 = roundtrip[name]["p50_ms"]
            rows.append(
                (f"execute round trip, {name}", f"{p50:.1f} ms", f"{p50 / raw:.2f}x raw jupyter_client ({raw:.1f} ms)")
            )
    recording = load("recording_overhead.json")
    if recording:
        with_, without = recording["p50_ms"]["with recording"], recording["p50_ms"]["without recording"]
        rows.append(
            (
                "trivial execute with transcript recording",
                f"{with_:.2f} ms",
                f"{without:.2f} ms without (+{recording['overhead']:.1%})",
            )
        )
    agent = load("agent_roundtrips.json").get("median", {})
    if agent:
        base = agent["stateful session"]
        for name in ("fresh process, naive", "fresh process, resend-all"):
            row = agent[name]
            rows.append(
                (
                    f"agent CSV scenario, {name}",
                    f"{row['tool_calls']:.0f} calls, {row['sandbox_seconds']:.2f} s",
                    f"stateful: {base['tool_calls']:.0f} calls, {base['sandbox_seconds']:.2f} s",
                )
            )
    lines = [
        f"Machine: {platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        "",
        "| measure | sandkernel | baseline |",
        "|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    text = "\n".join(lines) + "\n"
    results_path("SUMMARY.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
