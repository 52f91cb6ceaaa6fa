#!/usr/bin/env bash
# Every benchmark, one after the other (about 6 minutes on a 2-core machine), then the summary.
# Each script measures its baseline in the same run and prints medians, p95 and ratios.
# Usage: bash bench/run_all.sh [--quick] [--step NAME]   (--quick: a few samples each, for a smoke
# run; --step: that step alone, then the summary of what the results directory holds)
#        bash bench/run_all.sh --list                      (the steps' names, one per line)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here"
quick=0; only=""
while [ $# -gt 0 ]; do
    case "$1" in
        --quick) quick=1 ;;
        --step) only="$2"; shift ;;
        --list) only="--list" ;;
        *) echo "usage: bash bench/run_all.sh [--quick] [--step NAME] | --list" >&2; exit 2 ;;
    esac
    shift
done
n() { if [ "$quick" = 1 ]; then echo "$2"; else echo "$1"; fi; }
# Quick (CI's smoke run, which must stay well inside CI's time): runc only; the full run does both.
runtimes=(runc)
[ "$quick" = 0 ] && [ "$only" != "--list" ] && docker info --format '{{json .Runtimes}}' | grep -q runsc && runtimes+=(runsc)
say() { echo; echo "== $* =="; }

cold_start() {
    say "cold start and execute round trip vs bare docker run"
    python cold_start.py --starts "$(n 10 1)" --executes "$(n 200 5)"
}
execute_roundtrip() {
    say "execute round trip: session API, websocket, raw jupyter_client, Kernel Gateway"
    python execute_roundtrip.py --n "$(n 200 5)"
}
session_acquire() {
    for runtime in "${runtimes[@]}"; do
        say "session acquire -> first result ($runtime): warm pool, cold start, bare docker"
        python session_acquire.py --n "$(n 10 1)" --runtime "$runtime"
    done
}
time_to_interactive() {
    for runtime in "${runtimes[@]}"; do
        # The issue's n=100: run it alone (bench/README.md). Quick (the smoke test's): one sample of each.
        local tti=50; [ "$runtime" = runsc ] && tti=20
        say "time to interactive ($runtime): create -> 1+1 / pandas, sequential, staggered, burst; pool, pool off, bare docker"
        python time_to_interactive.py --runtime "$runtime" --n "$(n "$tti" 1)" --references "$(n 50 1)" \
            --modes "$(n sequential,staggered,burst sequential,burst)"
    done
}
throughput_density() {
    for runtime in "${runtimes[@]}"; do
        local sessions=50; [ "$runtime" = runsc ] && sessions=20  # 50 under runc is the density target
        say "throughput, density and output ($runtime)"
        python throughput_density.py --runtime "$runtime" --sessions "$(n "$sessions" 3)" --seconds "$(n 5 1)" --repeats "$(n 5 1)" \
            --sequential "$(n 200 20)" --settle "$(n 10 1)"
    done
}
density() {
    for runtime in "${runtimes[@]}"; do
        local sessions=200; [ "$runtime" = runsc ] && sessions=50  # runsc: 50 measured on this 2-core machine
        say "density: $(n "$sessions" 4) idle sessions ($runtime): execute p99, idle gateway CPU, memory vs bare"
        python density.py --runtime "$runtime" --sessions "$(n "$sessions" 4)" --samples "$(n 300 20)" \
            --idle-seconds "$(n 20 2)" --settle "$(n 10 1)" --old-drain
    done
}
door_roundtrip() {
    for runtime in "${runtimes[@]}"; do
        say "what each door adds to a call ($runtime): MCP over HTTP, shell, deepagents vs the session API"
        python door_roundtrip.py --n "$(n 100 3)" --runtime "$runtime"
    done
}
recording_overhead() {
    say "transcript recording overhead"
    python recording_overhead.py --n "$(n 300 5)"
}
accounting_overhead() {
    say "per-cell accounting overhead (${runtimes[*]}): off, on, on without the fanotify watch"
    python accounting_overhead.py --n "$(n 300 5)" "${runtimes[@]/#/--runtime=}"
}
controls_overhead() {
    say "production controls on a trivial execute (runc): off, defaults (accounting + audit), + example policy"
    python controls_overhead.py --n "$(n 300 5)"
}
cluster() {
    say "cluster (runc; 5 gateways on this one machine and engine): forwarding overhead, create through another host, create throughput 1 vs 3 hosts"
    if [ "$quick" = 1 ]; then python cluster.py --quick; else python cluster.py; fi
}
snapshots() {
    say "snapshots (${runtimes[*]}): pause, resume, fork vs cold start + re-running the cells"
    python snapshots.py --repeats "$(n 3 1)" --sizes "$(n 50,200 5)" --forks "$(n 3 2)" "${runtimes[@]/#/--runtime=}"
}
noisy_neighbour() {
    for runtime in "${runtimes[@]}"; do
        say "noisy neighbour ($runtime): another tenant's 1+1 p50/p99 alone vs while one tenant freezes its helpers and floods file calls, forks at its limit, pauses large workspaces"
        python noisy_neighbour.py --runtime "$runtime" --n "$(n 200 5)" --conditions "$(n freeze,fork,pause,all all)" \
            --cycles "$(n 2 1)" --flood "$(n 20 10)" --helper-timeout "$(n 5 2)" --large-sessions "$(n 2 1)" \
            --workspace-mb "$(n 64 4)" --forks "$(n 3 1)"
    done
}
agent_roundtrips() {
    say "stateful session vs a fresh process per call (agent, CSV scenario)"
    python agent_roundtrips.py --runs "$(n 5 1)"
}

steps=(cold_start execute_roundtrip session_acquire time_to_interactive throughput_density density door_roundtrip
       recording_overhead accounting_overhead controls_overhead cluster snapshots agent_roundtrips noisy_neighbour)
if [ "$only" = "--list" ]; then
    printf '%s\n' "${steps[@]}"
    exit 0
fi
if [ -n "$only" ]; then
    [[ " ${steps[*]} " == *" $only "* ]] || { echo "no step named $only; --list names them" >&2; exit 2; }
    "$only"
else
    for name in "${steps[@]}"; do "$name"; done
fi
say "summary"
python summarize.py
