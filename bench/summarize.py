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


def ms(value: float) -> str:
    return f"{value:.1f} ms" if value < 100 else f"{value:.0f} ms"


def contender_p50(runs: dict, contender: str, mode: str, cell: str) -> str:
    """One contender's p50 (p99) in a time-to-interactive run, or what failed."""
    row = runs.get(contender, {}).get(mode, {}).get(cell)
    if row is None:
        return ""
    if "p50_ms" not in row:
        return f"{contender} all {row['failed']} failed"
    failed = f", {row['failed']} failed" if row["failed"] else ""
    return f"{contender} {ms(row['p50_ms'])} (p99 {ms(row['p99_ms'])}{failed})"


def time_to_interactive_rows(data: dict) -> list[tuple[str, str, str]]:
    """Per runtime, mode and cell: the pool's p50 (p99) and the pool-off one beside bare docker
    run's (and the pool without preload's, for the pandas cell); then the issue's targets."""
    rows = []
    for runtime, result in data.items():
        runs, n = result["runs"], result["n"]
        for mode in result["modes"]:
            for cell in ("1+1", "pandas read_csv"):
                ours = [contender_p50(runs, c, mode, cell) for c in ("pool + preload", "pool off")]
                theirs = [contender_p50(runs, c, mode, cell) for c in ("bare docker run", "pool without preload")]
                rows.append(
                    (
                        f"time to interactive: create -> {cell}, {mode}, n={n} ({runtime})",
                        "; ".join(x for x in ours if x),
                        "; ".join(x for x in theirs if x),
                    )
                )
        for target in result["targets"]:
            value = ms(target["value"]) if target["unit"] == "ms" else f"{target['value']:.2f}x"
            rows.append((f"target: {target['target']} ({runtime})", value, "met" if target["met"] else "MISSED"))
    return rows


def density_rows(data: dict) -> list[tuple[str, str, str]]:
    """bench/density.py: what N idle sessions cost the one that works, and the gateway."""
    rows = []
    for runtime, r in data.items():
        n, alone, after, crowd, rand = r["sessions"], r["alone"], r["alone_after"], r["crowd_idle"], r["random_session"]
        old = r.get("crowd_idle_old_drain")
        rows += [
            (
                f"trivial execute p50 / p99, random session of {n} idle ({runtime})",
                f"{ms(rand['p50_ms'])} / {ms(rand['p99_ms'])}",
                f"one session alone {ms(alone['p50_ms'])} / {ms(alone['p99_ms'])} before, "
                f"{ms(after['p50_ms'])} / {ms(after['p99_ms'])} after (p99 {r['ratio_p99']:.2f}x; target <= 2x)",
            ),
            (
                f"idle memory per session, {n} sessions ({runtime})",
                f"{r['idle_session_mib']:.1f} MiB",
                f"bare ipykernel container {r['bare_idle_kernel_mib']:.1f} MiB "
                f"({r['idle_session_mib'] / r['bare_idle_kernel_mib']:.2f}x; target <= 1.10x)",
            ),
            (
                f"idle gateway CPU, {n} idle sessions ({runtime})",
                f"{crowd['gateway_cpu_percent']:.1f}% of a core, {crowd['threads']} threads",
                f"one session {alone['gateway_cpu_percent']:.1f}%"
                + (f"; drain polling every second (before issue 17) {old['gateway_cpu_percent']:.1f}%" if old else ""),
            ),
        ]
    return rows


def cluster_rows(data: dict) -> list[tuple[str, str, str]]:
    """bench/cluster.py: what forwarding adds (execute, NDJSON stream, create) beside the same
    call straight to the owning host, create throughput 1 vs 3 hosts, the forwarding target."""
    if not data:
        return []
    rows, calls = [], {**data["forwarding"], **data["create"]}
    for kind in ("execute 1+1", "NDJSON stream execute 1+1", "create"):
        direct = calls.get(f"{kind}, straight to the owner")
        forwarded = calls.get(f"{kind}, through another host (forwarded)")
        if direct and forwarded:
            rows.append(
                (
                    f"cluster: {kind} through another host, p50 ({data['runtime']})",
                    f"{ms(forwarded['p50_ms'])} ({forwarded['added_p50_ms']:+.2f} ms)",
                    f"straight to the owning host {ms(direct['p50_ms'])} ({forwarded['ratio_p50']:.2f}x)",
                )
            )
    throughput, burst = data["throughput"], data["burst"]
    rows.append(
        (
            f"cluster: create throughput, burst of {burst} through one endpoint, 3 hosts ({data['runtime']})",
            f"{throughput['3 hosts']['sessions_per_s']:.2f} sessions/s",
            f"1 host {throughput['1 host']['sessions_per_s']:.2f}/s ({throughput['3 hosts']['ratio_to_1_host']:.2f}x); "
            f"all hosts on this one machine ({data['cpus']} cores) and Docker engine",
        )
    )
    for target in data["targets"]:
        rows.append((f"target: {target['target']}", f"{target['value']:+.2f} ms", "met" if target["met"] else "MISSED"))
    return rows


def noisy_neighbour_rows(data: dict) -> list[tuple[str, str, str]]:
    """bench/noisy_neighbour.py: another tenant's trivial execute under each noise condition,
    beside the better of its alone runs (issue 30's target: p50 and p99 within 2x)."""
    rows = []
    for runtime, result in data.items():
        alone = result["alone_best"]
        for name, row in result["conditions"].items():
            if "noise" not in row:
                continue
            failed = f"; {row['failed']} failed" if row["failed"] else ""
            rows.append(
                (
                    f"another tenant's 1+1 p50 / p99 while one tenant {name}, n={row['n']} ({runtime})",
                    f"{ms(row['p50_ms'])} / {ms(row['p99_ms'])}",
                    f"alone {ms(alone['p50_ms'])} / {ms(alone['p99_ms'])} ({row['ratio_p50']:.2f}x / "
                    f"{row['ratio_p99']:.2f}x{failed}; target <= {result['target']:g}x: "
                    f"{'met' if row['within_target'] else 'MISSED'})",
                )
            )
    return rows


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
    rows += time_to_interactive_rows(load("time_to_interactive.json"))
    rows += density_rows(load("density.json"))
    roundtrip = load("execute_roundtrip.json").get("results", {})
    raw = roundtrip.get("raw jupyter_client (sandkernel kernel)", {}).get("p50_ms")
    for name in ("sandkernel session API", "sandkernel websocket", "Kernel Gateway 3 websocket (local kernel)"):
        if name in roundtrip and raw:
            p50 = roundtrip[name]["p50_ms"]
            rows.append(
                (f"execute round trip, {name}", f"{p50:.1f} ms", f"{p50 / raw:.2f}x raw jupyter_client ({raw:.1f} ms)")
            )
    for runtime, data in load("throughput_density.json").items():
        n = data["sessions"]
        rows.append(
            (f"sequential executes/s, one session ({runtime})", f"{data['sequential_executes_per_s']:.0f}/s", "")
        )
        rows.append(
            (
                f"executes/s, 10 and {n} concurrent sessions ({runtime})",
                f"{data['executes_per_s_10_sessions']:.0f}/s, {data[f'executes_per_s_{n}_sessions']:.0f}/s",
                "",
            )
        )
        rows.append((f"{n} sessions started at once ({runtime})", f"{data['start_all_seconds']:.1f} s", ""))
        rows.append(
            (
                f"idle memory per session ({runtime})",
                f"{data['idle_session_mib']:.1f} MiB",
                f"bare ipykernel container {data['bare_idle_kernel_mib']:.1f} MiB "
                f"({data['idle_session_mib'] / data['bare_idle_kernel_mib']:.2f}x)",
            )
        )
        rows.append(
            (
                f"10 MB printed / 1 MB PNG returned ({runtime})",
                f"{data['output_10mb_ms']:.0f} / {data['output_1mb_png_ms']:.0f} ms",
                f"raw jupyter_client {data['raw_output_10mb_ms']:.0f} / {data['raw_output_1mb_png_ms']:.0f} ms",
            )
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
    accounting = load("accounting_overhead.json")
    for runtime in ("runc", "runsc"):
        for workspace, data in accounting.get(runtime, {}).items():
            on, off = data["on"]["p50_ms"], data["off"]["p50_ms"]
            rows.append(
                (
                    f"trivial execute with per-cell accounting ({runtime}, {workspace})",
                    f"{on:.2f} ms",
                    f"{off:.2f} ms off ({data['ratio_p50 on'] - 1:+.1%}); walking every cell "
                    f"{data['ratio_p50 on, walk every cell'] - 1:+.1%}",
                )
            )
    controls = load("controls_overhead.json").get("runc", {})
    if controls:
        off = next(iter(controls.values()))  # the baseline comes first
        for name, row in list(controls.items())[1:]:
            rows.append(
                (
                    f"trivial execute, session API, controls {name} (runc)",
                    f"{row['p50_ms']:.2f} ms",
                    f"{off['p50_ms']:.2f} ms with all off ({row['ratio_to_off'] - 1:+.1%})",
                )
            )
    rows += cluster_rows(load("cluster.json"))
    for runtime, sizes in load("snapshots.json").items():
        for size, data in sizes.items():
            fork = next(name for name in data if name.startswith("fork of "))
            base, forks = data["cold start + cells"]["p50_s"], fork.removeprefix("fork of ")
            rows.append(
                (
                    f"pause / resume ({', '.join(data['restored_by'])}), {size} session ({runtime})",
                    f"{data['pause']['p50_s']:.2f} / {data['resume']['p50_s']:.2f} s",
                    f"cold start + the same cells {base:.2f} s (resume {data['resume']['ratio_to_baseline']:.2f}x)",
                )
            )
            rows.append(
                (
                    f"{fork}, {size} session ({runtime})",
                    f"{data[fork]['p50_s']:.2f} s",
                    f"{forks} cold starts + cells at once {data[f'{forks} x cold start + cells']['p50_s']:.2f} s "
                    f"({data[fork]['ratio_to_baseline']:.2f}x)",
                )
            )
    rows += noisy_neighbour_rows(load("noisy_neighbour.json"))
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
