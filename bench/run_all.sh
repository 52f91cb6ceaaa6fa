#!/usr/bin/env bash
# Every benchmark, one after the other (about 6 minutes on a 2-core machine), then the summary.
# Each script measures its baseline in the same run and prints medians, p95 and ratios.
# Usage: bash bench/run_all.sh [--quick]   (--quick: a few samples each, for a smoke run)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
quick=0; [ "${1:-}" = "--quick" ] && quick=1
n() { if [ "$quick" = 1 ]; then echo "$2"; else echo "$1"; fi; }
# Quick (CI's smoke run, which must stay well inside CI's time): runc only; the full run does both.
runtimes=(runc)
[ "$quick" = 0 ] && docker info --format '{{json .Runtimes}}' | grep -q runsc && runtimes+=(runsc)
step() { echo; echo "== $* =="; }
step "cold start and execute round trip vs bare docker run"
python cold_start.py --starts "$(n 10 1)" --executes "$(n 200 5)"
step "execute round trip: session API, websocket, raw jupyter_client, Kernel Gateway"
python execute_roundtrip.py --n "$(n 200 5)"
for runtime in "${runtimes[@]}"; do
    step "session acquire -> first result ($runtime): warm pool, cold start, bare docker"
    python session_acquire.py --n "$(n 10 1)" --runtime "$runtime"
done
for runtime in "${runtimes[@]}"; do
    # The issue's n=100: run it alone (bench/README.md). Quick: 2 samples under runc (the smoke test's).
    tti=50; tti_quick=2; [ "$runtime" = runsc ] && tti=20 && tti_quick=1
    step "time to interactive ($runtime): create -> 1+1 / pandas, sequential, staggered, burst; pool, pool off, bare docker"
    python time_to_interactive.py --runtime "$runtime" --n "$(n "$tti" "$tti_quick")" --references "$(n 50 3)" \
        --modes "$(n sequential,staggered,burst sequential,burst)"
done
for runtime in "${runtimes[@]}"; do
    sessions=50; [ "$runtime" = runsc ] && sessions=20  # 50 under runc is the density target
    step "throughput, density and output ($runtime)"
    python throughput_density.py --runtime "$runtime" --sessions "$(n "$sessions" 3)" --seconds "$(n 5 1)" --repeats "$(n 5 1)"
done
for runtime in "${runtimes[@]}"; do
    sessions=200; [ "$runtime" = runsc ] && sessions=50  # runsc: 50 measured on this 2-core machine
    step "density: $(n "$sessions" 4) idle sessions ($runtime): execute p99, idle gateway CPU, memory vs bare"
    python density.py --runtime "$runtime" --sessions "$(n "$sessions" 4)" --samples "$(n 300 20)" \
        --idle-seconds "$(n 20 2)" --settle "$(n 10 1)" --old-drain
done
for runtime in "${runtimes[@]}"; do
    step "what each door adds to a call ($runtime): MCP over HTTP, shell, deepagents vs the session API"
    python door_roundtrip.py --n "$(n 100 3)" --runtime "$runtime"
done
step "transcript recording overhead"
python recording_overhead.py --n "$(n 300 5)"
step "per-cell accounting overhead (${runtimes[*]}): off, on, on without the fanotify watch"
python accounting_overhead.py --n "$(n 300 5)" "${runtimes[@]/#/--runtime=}"
step "production controls on a trivial execute (runc): off, defaults (accounting + audit), + example policy"
python controls_overhead.py --n "$(n 300 5)"
step "cluster (runc; 5 gateways on this one machine and engine): forwarding overhead, create through another host, create throughput 1 vs 3 hosts"
if [ "$quick" = 1 ]; then python cluster.py --quick; else python cluster.py; fi
step "snapshots (${runtimes[*]}): pause, resume, fork vs cold start + re-running the cells"
python snapshots.py --repeats "$(n 3 1)" --sizes "$(n 50,200 5)" --forks "$(n 3 2)" "${runtimes[@]/#/--runtime=}"
step "stateful session vs a fresh process per call (agent, CSV scenario)"
python agent_roundtrips.py --runs "$(n 5 1)"
step "summary"
python summarize.py
