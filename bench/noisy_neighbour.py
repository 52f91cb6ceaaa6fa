"""What a noisy tenant costs another tenant's trivial execute (issue 30), in one run.

One ``sandkernel serve`` with two tenants (a --tokens-file): the canary is tenant bob's one
session, running ``1+1`` through the session API (the Python client) back to back; its p50 / p99
are measured alone, then while tenant alice makes noise, then alone again. The noise, each kind as
a loop of cycles (a kind alone with ``--conditions``, and all of them at once):

- freeze + flood: a session whose cell SIGSTOPs every new process in its sandbox (the security
  test's FREEZE_EVERY_NEW_PROCESS, tests/security/test_frozen_helpers.py), so each file helper
  the gateway execs there stops; a cycle is ``--flood`` file listings of it at once (answers 409,
  429 and 504 are the expected ones: its helpers are killed at --helper-timeout). Made fresh for
  each condition and deleted after it (its freezer thread keeps running until then).
- fork at the limit: a session forked into as many sessions as alice has room for under
  --max-sessions (at most 10), then one more fork (which must be refused), then the forks deleted.
- pause large workspaces: ``--large-sessions`` sessions holding ``--workspace-mb`` MiB of random
  bytes each in /workspace (uploaded, so a resume re-runs no cell), paused all at once, then
  resumed all at once.

Under noise the canary keeps going until it has ``--n`` samples AND every noise loop running has
finished ``--cycles`` cycles (so a p99 covers whole cycles, not one phase), or ``--max-seconds``.
The canary is a process of its own (this script with ``--canary``), as bob's client would be:
two tenants never share a client's event loop, and when they did here, alice's replies (a flood
round's twenty answers, a fork's session models) were handled on the loop that was timing bob's
call, which put the bench's own queueing into bob's p99. Alice's noise comes from this process.

Ratios are taken against the better of the two alone runs (before and after the noise), as
bench/density.py does: the load of a shared machine moves. Target (issue 30): p50 and p99 under
all the noise at once within 2x of alone, both runtimes, and no canary call failing.
Prints a table; writes bench/results/noisy_neighbour.json (per runtime).
Usage: python bench/noisy_neighbour.py [--runtime runc|runsc] [--n 200] [--conditions freeze,fork,pause,all]
       python bench/noisy_neighbour.py --n 5 --conditions all --workspace-mb 4 --large-sessions 1 \\
           --flood 10 --helper-timeout 2 --cycles 1                       (quick: well under 30 s, runc)
"""

from __future__ import annotations

import argparse
import ast
import asyncio
import collections
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from density import percentiles, process_cpu_seconds
from results_dir import save_for_runtime
from served import served_gateway

from sandkernel.agent.client import AsyncSandkernel, AsyncSession
from sandkernel.agent.errors import ClientError, LimitExceededError
from sandkernel.gateway.auth import new_token

FROZEN_HELPERS_TEST = Path(__file__).resolve().parents[1] / "tests" / "security" / "test_frozen_helpers.py"
TARGET = 2.0  # another tenant's p50 and p99 under the noise: within 2x of alone
MAX_FORK = 10  # the API's most forks per call
FILE_MIB = 16  # a large workspace is files of at most this size
WARMUP = 10
CANARY_CODE = "1+1"  # bob's execute: trivial, so its time is the path's, not the code's
ALONE, ALONE_AFTER, ALL = "alone", "alone, after the noise", "all"
CONDITIONS = {
    "freeze": "freezes its helpers + floods file listings",
    "fork": "forks at its session limit",
    "pause": "pauses / resumes large workspaces",
    ALL: "does all of these at once",
}


def freeze_every_new_process() -> str:
    """The security test's cell (one copy of it): read from the test's source rather than
    imported, since importing it loads the test suite's fixtures and their imports."""
    for node in ast.parse(FROZEN_HELPERS_TEST.read_text()).body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", [])]
        if "FREEZE_EVERY_NEW_PROCESS" in names:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"no FREEZE_EVERY_NEW_PROCESS in {FROZEN_HELPERS_TEST}")


def gateway_pid() -> int:
    """The ``sandkernel serve`` this process started (served_gateway's child)."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid() and b"sandkernel.cli\0serve" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):
            continue
    raise RuntimeError("no sandkernel serve child found")


def machine_cpu() -> tuple[int, int]:
    """(busy, total) jiffies of all cores since boot (/proc/stat; idle and iowait are not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4], sum(fields)


class CpuWindow:
    """The gateway process's CPU (% of one core) and the machine's (% of all cores) over a window."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.began, self.gateway, self.machine = time.monotonic(), process_cpu_seconds(pid), machine_cpu()

    def percent(self) -> dict[str, float | None]:
        wall, gateway, (busy, total) = time.monotonic() - self.began, process_cpu_seconds(self.pid), machine_cpu()
        return {
            "gateway_cpu_percent": None if gateway is None else 100 * (gateway - self.gateway) / wall,
            "machine_busy_percent": 100 * (busy - self.machine[0]) / max(1, total - self.machine[1]),
        }


def answer_of(outcome: object) -> str:
    """How a noise call ended, as counted: its HTTP status, or the exception's name."""
    if isinstance(outcome, ClientError):
        return str(outcome.status or type(outcome).__name__)
    if isinstance(outcome, BaseException):
        return type(outcome).__name__
    return "ok"


class Noise:
    """One kind of alice's noise: made ready (unmeasured), run in cycles until told to stop
    (the current cycle is finished, so nothing is left half done), then cleaned up."""

    name = ""

    def __init__(self) -> None:
        self.cycles = 0
        self.answers: collections.Counter[str] = collections.Counter()
        self.cycle_seconds: list[float] = []
        self.cycled = asyncio.Condition()  # notified after each cycle

    async def setup(self) -> None:
        pass

    async def cycle(self) -> None:
        raise NotImplementedError

    async def teardown(self) -> None:
        pass

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            began = time.monotonic()
            await self.cycle()
            self.cycle_seconds.append(time.monotonic() - began)
            self.cycles += 1
            async with self.cycled:
                self.cycled.notify_all()

    async def until_cycles(self, count: int) -> None:
        """Return once ``count`` cycles have ended."""
        async with self.cycled:
            await self.cycled.wait_for(lambda: self.cycles >= count)

    def summary(self) -> dict[str, Any]:
        seconds = sorted(self.cycle_seconds)
        return {
            "cycles": self.cycles,
            "cycle_p50_s": seconds[len(seconds) // 2] if seconds else None,
            "answers": dict(sorted(self.answers.items())),
        }


class FreezeAndFlood(Noise):
    name = "freeze"

    def __init__(self, alice: AsyncSandkernel, flood_client: AsyncSandkernel, flood: int) -> None:
        super().__init__()
        self.alice, self.flood_client, self.flood = alice, flood_client, flood
        self.frozen: AsyncSession | None = None

    async def setup(self) -> None:
        self.frozen = await self.alice.create_session()
        reply = await self.frozen.run(freeze_every_new_process(), check=True)
        if "freezing" not in reply.text:
            raise RuntimeError(f"the freezer did not start: {reply.text!r}")

    async def cycle(self) -> None:
        # The flood's own client: no retries, so each call's first answer is what is counted.
        target = AsyncSession(self.flood_client, self.frozen.info)
        outcomes = await asyncio.gather(*(target.list_files() for _ in range(self.flood)), return_exceptions=True)
        self.answers.update(answer_of(outcome) for outcome in outcomes)

    async def teardown(self) -> None:
        await self.frozen.delete()


class ForkAtLimit(Noise):
    name = "fork"

    def __init__(self, alice: AsyncSandkernel, parent: AsyncSession, max_sessions: int) -> None:
        super().__init__()
        self.alice, self.parent, self.max_sessions = alice, parent, max_sessions

    async def cycle(self) -> None:
        room = min(MAX_FORK, self.max_sessions - len(await self.alice.list_sessions()))
        forks: list[AsyncSession] = []
        try:
            if room > 0:
                forks += await self.parent.fork(room)
                self.answers["forks made"] += len(forks)
            try:  # one more: the limit must hold
                extra = await self.parent.fork(1)
                forks += extra
                self.answers["a fork past the limit was made"] += 1
            except LimitExceededError:
                self.answers["refused at the limit"] += 1
        except ClientError as err:
            self.answers[answer_of(err)] += 1
        finally:
            outcomes = await asyncio.gather(*(fork.delete() for fork in forks), return_exceptions=True)
            self.answers.update(f"delete {answer_of(outcome)}" for outcome in outcomes if outcome is not None)


class PauseLargeWorkspaces(Noise):
    name = "pause"

    def __init__(self, sessions: list[AsyncSession]) -> None:
        super().__init__()
        self.sessions = sessions

    async def cycle(self) -> None:
        for step in ("pause", "resume"):
            outcomes = await asyncio.gather(*(getattr(s, step)() for s in self.sessions), return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, dict) and step == "resume":
                    self.answers[f"resume: restored_by {outcome.get('restored_by')}"] += 1
                else:
                    self.answers[f"{step}: {answer_of(outcome)}"] += 1


CANARY_ENV = ("SANDKERNEL_BENCH_URL", "SANDKERNEL_BENCH_TOKEN", "SANDKERNEL_BENCH_SESSION")


async def canary_samples(
    call: Callable[[], Awaitable[object]], n: int, enough: Callable[[], bool], max_seconds: float
) -> tuple[list[float], int, float]:
    """Seconds per canary call, back to back, until ``n`` samples and ``enough()`` (every noise
    loop has run its cycles), or ``max_seconds``; also the failed calls and the wall time."""
    samples: list[float] = []
    failed = 0
    began = time.monotonic()
    while len(samples) < n or not enough():
        if time.monotonic() - began > max_seconds:
            print(f"  (canary stopped at --max-seconds {max_seconds:.0f})", file=sys.stderr, flush=True)
            break
        t0 = time.perf_counter()
        try:
            await call()
        except ClientError as err:
            failed += 1
            print(f"  canary call failed: {err}", file=sys.stderr, flush=True)
            continue
        samples.append(time.perf_counter() - t0)
    return samples, failed, time.monotonic() - began


async def stdin_lines() -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    loop = asyncio.get_running_loop()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


def tell(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


async def canary_process(request_timeout: float) -> None:
    """``--canary``: bob's client, alone in its process. Told a measure on stdin as a JSON line
    (``{"n": .., "max_seconds": ..}``), it samples until it has ``n`` and reads a second line
    (the noise has run its cycles), then writes ``{"samples", "failed", "seconds"}``."""
    url, token, session_id = (os.environ[name] for name in CANARY_ENV)
    orders = await stdin_lines()
    async with AsyncSandkernel(url, token, request_timeout=request_timeout) as bob:
        session = await bob.get_session(session_id)
        call = functools.partial(session.run, CANARY_CODE, check=True)
        for _ in range(WARMUP):
            await call()
        tell({"ready": True})
        while line := await orders.readline():
            order = json.loads(line)
            told = asyncio.create_task(orders.readline())  # the second line: the noise is done
            samples, failed, seconds = await canary_samples(call, order["n"], told.done, order["max_seconds"])
            await told
            tell({"samples": samples, "failed": failed, "seconds": seconds})


class Canary:
    """The parent's handle on the canary process (see :func:`canary_process`)."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(cls, url: str, token: str, session_id: str, request_timeout: float) -> Canary:
        env = {**os.environ, **dict(zip(CANARY_ENV, (url, token, session_id), strict=True))}
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            __file__,
            "--canary",
            "--request-timeout",
            str(request_timeout),
            env=env,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        canary = cls(process)
        if "ready" not in await canary._answer():
            raise RuntimeError("the canary process did not get ready")
        return canary

    async def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = await self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the canary process ended (exit {await self.process.wait()}); its stderr says why")
        return json.loads(line)

    def _order(self, message: dict[str, Any]) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write((json.dumps(message) + "\n").encode())

    async def measure(
        self, n: int, max_seconds: float, noise_done: Awaitable[object]
    ) -> tuple[list[float], int, float]:
        """Samples until ``n`` of them and ``noise_done`` has finished (see canary_samples)."""
        self._order({"n": n, "max_seconds": max_seconds})
        with contextlib.suppress(asyncio.TimeoutError):  # the canary stops at max_seconds itself
            await asyncio.wait_for(noise_done, max_seconds)
        self._order({"enough": True})
        answer = await self._answer()
        return answer["samples"], answer["failed"], answer["seconds"]

    async def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        await self.process.wait()


async def large_workspace(alice: AsyncSandkernel, mib: int) -> AsyncSession:
    session = await alice.create_session()
    left = mib
    while left > 0:
        size = min(FILE_MIB, left)
        await session.upload(f"large-{left}.bin", os.urandom(size << 20))
        left -= size
    return session


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    parser.add_argument("--n", type=int, default=200, help=f"canary executes per condition (after {WARMUP} warm-up)")
    parser.add_argument(
        "--conditions", default=",".join(CONDITIONS), help=f"noise conditions, comma-separated, of {list(CONDITIONS)}"
    )
    parser.add_argument("--cycles", type=int, default=2, help="noise cycles (each loop) a noisy condition covers")
    parser.add_argument("--max-seconds", type=float, default=240, help="bound on one condition's measuring")
    parser.add_argument("--flood", type=int, default=20, help="file listings of the frozen session at once")
    parser.add_argument("--helper-timeout", type=float, default=5, help="the gateway's --helper-timeout")
    parser.add_argument("--large-sessions", type=int, default=2, help="sessions paused and resumed at once")
    parser.add_argument("--workspace-mb", type=int, default=64, help="MiB of random files in each of them")
    parser.add_argument("--forks", type=int, default=3, help="alice's room for forks: --max-sessions beyond hers")
    parser.add_argument("--canary", action="store_true", help=argparse.SUPPRESS)  # the canary's own process
    parser.add_argument("--request-timeout", type=float, default=600, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.canary:
        await canary_process(args.request_timeout)
        return
    conditions = [c for c in args.conditions.split(",") if c]
    if unknown := set(conditions) - set(CONDITIONS):
        parser.error(f"unknown conditions {sorted(unknown)}; known: {list(CONDITIONS)}")
    # alice holds the frozen session, the fork parent and the large workspaces; forks fill the rest
    max_sessions = 2 + args.large_sessions + args.forks
    tokens = {"alice": new_token(), "bob": new_token()}
    flags = ["--default-runtime", args.runtime, "--max-sessions", str(max_sessions)]
    flags += ["--helper-timeout", str(args.helper_timeout)]
    bound = args.helper_timeout * 3 + 60
    rows: dict[str, dict[str, Any]] = {}
    began = time.monotonic()
    async with (
        served_gateway(flags, request_timeout=600, tokens=tokens) as alice,
        AsyncSandkernel(alice.url, tokens["bob"], request_timeout=bound) as bob,
        AsyncSandkernel(alice.url, tokens["alice"], request_timeout=bound, max_retries=0) as flood_client,
    ):
        canary_session, parent, *large = await asyncio.gather(
            bob.create_session(),
            alice.create_session(),
            *(large_workspace(alice, args.workspace_mb) for _ in range(args.large_sessions)),
        )
        await parent.run("x = 6 * 7", check=True)  # a cell for each fork to replay
        pid = gateway_pid()
        canary = await Canary.start(alice.url, tokens["bob"], canary_session.id, bound)

        async def measure(name: str, noises: list[Noise]) -> None:
            for noise in noises:
                await noise.setup()
            stop = asyncio.Event()
            loops = [asyncio.create_task(noise.run(stop)) for noise in noises]
            cycled = asyncio.gather(*(noise.until_cycles(noise.cycles + args.cycles) for noise in noises))
            cpu = CpuWindow(pid)
            try:
                samples, failed, seconds = await canary.measure(args.n, args.max_seconds, cycled)
                used = cpu.percent()
            finally:
                cycled.cancel()
                stop.set()
                await asyncio.wait_for(asyncio.gather(*loops), args.max_seconds + bound)
                for noise in noises:
                    await asyncio.wait_for(noise.teardown(), bound)
            rows[name] = {**percentiles(samples), "failed": failed, "seconds": seconds, **used}
            if noises:
                rows[name]["noise"] = {noise.name: noise.summary() for noise in noises}
            print(f"  {name}: {len(samples)} samples in {seconds:.1f} s", flush=True)

        def noises_for(condition: str) -> list[Noise]:
            kinds = {
                "freeze": lambda: FreezeAndFlood(alice, flood_client, args.flood),
                "fork": lambda: ForkAtLimit(alice, parent, max_sessions),
                "pause": lambda: PauseLargeWorkspaces(large),
            }
            return [make() for name, make in kinds.items() if condition in (name, ALL)]

        try:
            await measure(ALONE, [])
            for condition in conditions:
                await measure(CONDITIONS[condition], noises_for(condition))
            await measure(ALONE_AFTER, [])
        finally:
            await canary.close()
        await asyncio.gather(*(session.delete() for session in (canary_session, parent, *large)))
    base = {key: min(rows[ALONE][key], rows[ALONE_AFTER][key]) for key in ("p50_ms", "p99_ms")}
    print(
        f"\nanother tenant's {CANARY_CODE} ({args.runtime}, n>={args.n}; "
        f"ratios to the better alone run; target <= {TARGET:g}x)"
    )
    print(
        f"{'condition (what tenant alice does)':52} {'n':>5} {'p50 ms':>8} {'p99 ms':>8} {'x p50':>6} {'x p99':>6}"
        f" {'failed':>6} within"
        "  (gateway CPU, % of a core; machine busy, % of all cores)"
    )
    for name, row in rows.items():
        row["ratio_p50"] = row["p50_ms"] / base["p50_ms"]
        row["ratio_p99"] = row["p99_ms"] / base["p99_ms"]
        row["within_target"] = row["ratio_p50"] <= TARGET and row["ratio_p99"] <= TARGET and not row["failed"]
        print(
            f"{name:52} {row['n']:5} {row['p50_ms']:8.1f} {row['p99_ms']:8.1f} {row['ratio_p50']:6.2f} "
            f"{row['ratio_p99']:6.2f} {row['failed']:6} {'yes' if row['within_target'] else 'NO':6}  "
            f"({row['gateway_cpu_percent'] or 0:.0f}%; {row['machine_busy_percent']:.0f}%)"
        )
    for name, row in rows.items():
        for kind, noise in row.get("noise", {}).items():
            cycle = f" (p50 {noise['cycle_p50_s']:.1f} s)" if noise["cycles"] else ""
            print(f"  {name} / {kind}: {noise['cycles']} cycles{cycle}, {noise['answers']}")
    results = {
        "n": args.n,
        "alone_best": base,  # the better of the two alone runs: the ratios' baseline
        "target": TARGET,
        "settings": {
            "max_sessions": max_sessions,
            "helper_timeout": args.helper_timeout,
            "flood": args.flood,
            "large_sessions": args.large_sessions,
            "workspace_mb": args.workspace_mb,
            "cycles": args.cycles,
        },
        "conditions": rows,
        "seconds": time.monotonic() - began,
    }
    if CONDITIONS[ALL] in rows:
        results["within_target"] = rows[CONDITIONS[ALL]]["within_target"]
    print(f"({results['seconds']:.0f} s in all)")
    save_for_runtime("noisy_neighbour.json", args.runtime, results)


if __name__ == "__main__":
    asyncio.run(main())
