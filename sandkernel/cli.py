"""The ``sandkernel`` command line.

sandkernel demo                 an agent analyses a CSV in a sandbox; leaves report.png and a notebook
sandkernel agent TASK           run a task with Claude in a fresh sandbox (--file data.csv ...)
sandkernel run CODE             execute code (or - for stdin) in a fresh sandbox and print the result
sandkernel mcp                  serve MCP on stdin/stdout (Claude Code, Claude Desktop): Python sandboxes as tools
sandkernel image build          build the kernel image (works with no registry)
sandkernel cluster ...          many hosts: `cluster image build` builds the gateway image
sandkernel doctor               check Docker, the image, runc and runsc, and say how to fix
sandkernel kernelspec install   install the sandkernel-python kernelspecs for Jupyter tools
sandkernel reap                 remove containers left by crashed sandkernel processes (not recorded ones)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from sandkernel import __version__
from sandkernel.errors import ConfigError, SandkernelError
from sandkernel.extras import install_hint, missing_extra

RUNTIME_CHOICES = ["auto", "runc", "runsc"]
RUNTIME_HELP = "container runtime (default auto: gVisor where runsc is registered, else runc)"
SERVE_RESTARTS = """restarts:
  Sessions outlive the gateway process. Each one is recorded (before it is handed out) in
  STATE_DIR/catalog.sqlite3; a gateway started on the same --state-dir adopts every recorded
  sandbox before it accepts requests: variables, /workspace files, installed packages, idle
  timers and transcripts (continued in the same .ipynb, with a note where the gap was) carry on.
  A sandbox that died meanwhile is listed in state "lost" with the reason (exit code, OOM,
  removed) until it is deleted. Containers not in the catalog are reaped.
  SIGTERM/SIGINT: new requests get 503 "the gateway is restarting; retry"; running executions
  get --shutdown-grace seconds to finish, then their callers get status "detached" (ended_by
  "gateway_restart") while the code keeps running; websockets close with 1012 (service restart)
  and the containers keep running. --on-exit delete removes every container instead.
  A catalog the gateway cannot read (corrupt, or from a newer sandkernel) stops it with an
  error and a non-zero exit; nothing is deleted."""


def _local_gateway():  # type: ignore[no-untyped-def]
    """A gateway in this process for ``sandkernel agent`` without --url (imported when used)."""
    from sandkernel.local_gateway import local_gateway

    return local_gateway()


def _cmd_demo(args: argparse.Namespace) -> int:
    from sandkernel.demo import run_demo

    return run_demo(Path(args.notebook), runtime=args.runtime, workdir=Path(args.workdir))


def _cmd_serve(args: argparse.Namespace) -> int:
    from sandkernel.gateway.server import serve
    from sandkernel.gateway.settings import GatewaySettings

    # The audit stream's head hash (logged at start-up, rotation and shutdown) is the anchor an
    # operator keeps outside the audit directory: it reaches the log whatever --log-level says.
    audit_logger = logging.getLogger("sandkernel.gateway.audit")
    audit_logger.setLevel(min(audit_logger.getEffectiveLevel(), logging.INFO))
    asyncio.run(serve(GatewaySettings.from_args(args)))
    return 0


def _cmd_replay(args: argparse.Namespace) -> int:
    from sandkernel.notebooks.replay import run_replay_command

    return run_replay_command(
        args.notebook,
        until=args.until,
        runtime=args.runtime,
        profile=args.profile,
        rules_file=args.rules,
        timeout=args.timeout,
        files=args.file,
    )


def _cmd_diff(args: argparse.Namespace) -> int:
    from sandkernel.errors import ConfigError
    from sandkernel.notebooks.compare import compare_notebooks, exit_code, format_report, load_rules
    from sandkernel.notebooks.repair import load_notebook

    try:
        a, b = (load_notebook(Path(name))[0] for name in (args.first, args.second))
        rules = load_rules(args.rules)
    except ConfigError as err:
        print(f"sandkernel: {err}", file=sys.stderr)
        return 2
    verdicts = compare_notebooks(a, b, rules)
    print(format_report(verdicts))
    return exit_code(verdicts)


def _cmd_attach(args: argparse.Namespace) -> int:
    import urllib.error
    import urllib.request

    token = args.token or os.environ.get("SANDKERNEL_TOKEN")
    if not token:
        print("sandkernel: give the gateway token with --token or SANDKERNEL_TOKEN", file=sys.stderr)
        return 2
    request = urllib.request.Request(
        f"{args.url.rstrip('/')}/api/sessions/{args.session}", headers={"Authorization": f"token {token}"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            session = json.loads(response.read())
    except urllib.error.HTTPError as err:
        print(f"sandkernel: the gateway said {err.code}: {err.read().decode(errors='replace')}", file=sys.stderr)
        return 2
    except OSError as err:
        print(f"sandkernel: cannot reach the gateway at {args.url}: {err}", file=sys.stderr)
        return 2
    kernel_id = session["kernel"]["id"]
    print(f"session {session['id']}: kernel {kernel_id} ({session['kernel']['name']}), transcript {session['path']}")
    print("\n1. Start JupyterLab against the gateway:")
    print(f"   jupyter lab --gateway-url={args.url} --GatewayClient.auth_token={token} --port=8889")
    print("2. Adopt the agent's kernel (JupyterLab token from its start-up line):")
    print(
        f"   curl -X POST -H 'Authorization: token <JUPYTER_TOKEN>' http://127.0.0.1:8889/api/kernels "
        f'-d \'{{"kernel_id": "{kernel_id}"}}\''
    )
    print("3. In JupyterLab, open a notebook and pick that kernel (Kernel > Change Kernel > Use Kernel from Other")
    print("   Session). The agent's variables are there; the debugger panel works through the gateway.")
    print("   Shutting the kernel down from JupyterLab is refused (409): the session ends only through")
    print(f"   DELETE /api/sessions/{session['id']}, so closing JupyterLab leaves the agent working.")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from sandkernel.kernels.execution.session import KernelSession

    code = sys.stdin.read() if args.code == "-" else args.code

    async def run() -> int:
        from sandkernel.kernels.lifecycle.catalog import choose_default_runtime

        overrides = {"runtime": (await choose_default_runtime(args.runtime)).value}
        async with await KernelSession.start(profile=args.profile, overrides=overrides) as session:
            result = await session.execute(code, timeout=args.timeout)
        if args.json:
            print(json.dumps(result.to_dict(), indent=2))
        else:
            sys.stdout.write(result.text)
            if result.error:
                print("\n".join(result.error.traceback), file=sys.stderr)
            print(f"[{result.status.value} in {result.duration:.2f}s]", file=sys.stderr)
        return 0 if result.status.value == "ok" else 1

    return asyncio.run(run())


def _cmd_image_build(args: argparse.Namespace) -> int:
    from sandkernel.kernels.model.profiles import DEFAULT_IMAGE
    from sandkernel.kernels.sandbox.image import build_image

    build_image(tag=args.tag or DEFAULT_IMAGE, base=args.base, offline=args.offline, progress=print)
    return 0


def _cmd_doctor(args: argparse.Namespace) -> int:
    from sandkernel.kernels.sandbox.doctor import run_checks

    checks = run_checks()
    for check in checks:
        mark = "ok  " if check.ok else ("FAIL" if check.required else "warn")
        print(f"[{mark}] {check.name}: {check.detail}")
        if not check.ok and check.fix:
            print(f"       fix: {check.fix}")
    return 0 if all(c.ok for c in checks if c.required) else 1


def _cmd_kernelspec_install(args: argparse.Namespace) -> int:
    from sandkernel.kernels.sandbox.kernelspec import install_kernelspecs

    prefix = args.prefix or (None if args.user else sys.prefix)
    for path in install_kernelspecs(user=args.user, prefix=prefix):
        print(f"installed {path}")
    return 0


def _cmd_reap(args: argparse.Namespace) -> int:
    """Without --all, the sandboxes a stopped gateway left for the next one are kept: those its
    catalog (in --state-dir) records, and those the catalog of the state dir they are labelled
    with records. A catalog that cannot be read stops the command before anything is removed."""
    from sandkernel.kernels.lifecycle.reaper import catalogued_session_ids, reap_sync
    from sandkernel.kernels.sandbox.state_dir import state_dir, use_state_dir

    if args.all:
        report = reap_sync(everything=True)
        print(f"removed {len(report.removed)} container(s), every sandkernel container")
        return 0
    use_state_dir(args.state_dir)
    keep = catalogued_session_ids()
    report = reap_sync(keep=keep)
    print(
        f"removed {len(report.removed)} container(s); kept {report.kept}: owned by live processes, or recorded "
        f"for the next gateway in {state_dir()} (or another state dir)"
    )
    return 0


def _cmd_audit_verify(args: argparse.Namespace) -> int:
    from sandkernel.gateway.audit.verify import main as verify_main

    return verify_main(args.verify_args)


def _cmd_policy_check(args: argparse.Namespace) -> int:
    """Load an execution policy as ``serve --exec-policy`` would (errors name the line at fault)
    and, for each code file given, print what the review finds; exit 1 if any would be refused."""
    from sandkernel.kernels.policy import load_policy

    try:
        policy = load_policy(args.policy)
    except ConfigError as err:
        print(f"sandkernel: {err}", file=sys.stderr)
        return 2
    print(f"{args.policy}: the policy is valid (default action {policy.default.value})")
    refused = False
    for path in args.code:
        try:
            code = path.read_text()
        except (OSError, UnicodeDecodeError) as err:
            print(f"sandkernel: cannot read {path}: {err}", file=sys.stderr)
            return 2
        findings = policy.review(code, code if args.shell else None)
        print(f"{path}: {len(findings) or 'no'} finding(s)")
        for finding in findings:
            line = f"line {finding.line}" if finding.line else "cell"
            print(f"  {finding.action.value if finding.action else '?':5} {finding.rule} ({line}): {finding.message}")
            refused = refused or (finding.action is not None and finding.action.value == "deny")
    return 1 if refused else 0


def _missing(err: ModuleNotFoundError, command: str) -> int:
    """Say which extra ``command`` needs (a client-only install lacks the server's packages)."""
    print(f"sandkernel: {install_hint(command, missing_extra(err) or 'server')} ({err})", file=sys.stderr)
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sandkernel",
        description="Sandboxed, stateful Jupyter kernels for AI agents; every session recorded as a notebook.",
    )
    parser.add_argument("--version", action="version", version=f"sandkernel {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="DEBUG, INFO, WARNING (default) or ERROR")
    parser.add_argument("--log-format", choices=["text", "json"], default="text", help="log line format")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    from sandkernel.agent.cli import add_parser as add_agent_parser

    add_agent_parser(sub, local_gateway=_local_gateway)
    from sandkernel.mcp_stdio import add_parser as add_mcp_parser

    add_mcp_parser(sub)

    serve_help = "run the gateway: Jupyter-compatible kernel API and session API"
    try:
        from sandkernel.gateway.settings import add_arguments
    except ModuleNotFoundError as err:  # a client-only install: serve says what to install
        if missing_extra(err) is None:
            raise
        # Its flags are unknown here: every argument is taken as is, and the command explains.
        serve = sub.add_parser("serve", help=serve_help, add_help=False, prefix_chars="\0")
        serve.add_argument("serve_args", nargs="*")
        absent = err  # the except clause unbinds its own name
        serve.set_defaults(func=lambda _args: _missing(absent, "serve"))
    else:
        serve = sub.add_parser(
            "serve",
            help=serve_help,
            description="Run the gateway. Every setting below can also come from its environment variable or\n"
            "from a --config file; precedence: flags > environment > config file > defaults.",
            epilog=SERVE_RESTARTS,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        add_arguments(serve)
        serve.set_defaults(func=_cmd_serve)

    from sandkernel.notebooks.exit_codes import EXIT_CODES

    exit_codes = "exit codes:\n" + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items())
    replay = sub.add_parser(
        "replay",
        help="re-run a notebook in a fresh sandbox and give each code cell a verdict",
        description="Run each code cell of NOTEBOOK (a sandkernel transcript or any notebook nbformat reads) in a "
        "fresh sandbox through the session's execute, and compare its outputs with the notebook's. Verdicts: same, "
        "changed, new error, error gone, kernel died, timed out, not run. Writes NAME.replay.ipynb beside it.",
        epilog=exit_codes,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    replay.add_argument("notebook", help="the .ipynb to replay")
    replay.add_argument(
        "--until", type=int, default=None, metavar="N", help="run only the first N code cells (the rest: not run)"
    )
    replay.add_argument(
        "--runtime",
        choices=RUNTIME_CHOICES,
        default=None,
        help="container runtime (default: the one the transcript recorded, else $SANDKERNEL_RUNTIME, else auto: "
        "gVisor where runsc is registered, else runc)",
    )
    replay.add_argument("--profile", default=None, help="resource profile: default, small or large (default: default)")
    replay.add_argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="per-cell limit: a cell still running is interrupted, then its kernel restarted, and judged "
        "'timed out' (default 600)",
    )
    replay.add_argument("--rules", default=None, help='JSON [["regex", "replacement"], ...] for volatile text')
    replay.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH",
        help="an input file the session uploaded that is too large to be embedded in the transcript (repeatable)",
    )
    replay.set_defaults(func=_cmd_replay)

    diff = sub.add_parser(
        "diff",
        help="compare two notebooks cell by cell",
        epilog=exit_codes,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    diff.add_argument("first")
    diff.add_argument("second")
    diff.add_argument("--rules", default=None, help='JSON [["regex", "replacement"], ...] for volatile text')
    diff.set_defaults(func=_cmd_diff)

    attach = sub.add_parser("attach", help="print how to open an agent session's live kernel in JupyterLab")
    attach.add_argument("session", help="session id")
    attach.add_argument("--url", default="http://127.0.0.1:8888", help="gateway URL")
    attach.add_argument("--token", default=None, help="gateway token (default: $SANDKERNEL_TOKEN)")
    attach.set_defaults(func=_cmd_attach)

    demo = sub.add_parser(
        "demo",
        help="an agent analyses a sales CSV in a sandbox and leaves its notebook (offline without an API key)",
        description="The main job: an agent computes quarterly sales from a CSV in a sandboxed kernel, draws "
        "report.png and answers; the session notebook is written. With ANTHROPIC_API_KEY Claude does the task; "
        "without it a scripted conversation is played by a local offline Messages API server (said plainly), "
        "and the code still runs for real in the sandbox.",
    )
    demo.add_argument("--notebook", default="sandkernel-demo.ipynb", help="where to write the notebook")
    demo.add_argument("--workdir", default="sandkernel-demo", help="where sales.csv and report.png go")
    demo.add_argument("--runtime", choices=RUNTIME_CHOICES, default="auto", help=RUNTIME_HELP)
    demo.set_defaults(func=_cmd_demo)

    run = sub.add_parser("run", help="execute code in a fresh sandbox and print the result")
    run.add_argument("code", help="Python source, or - to read it from standard input")
    run.add_argument("--profile", default=None, help="profile name: default, small or large")
    run.add_argument("--runtime", choices=RUNTIME_CHOICES, default=None, help=RUNTIME_HELP)
    run.add_argument("--timeout", type=float, default=None, help="wall-clock limit in seconds")
    run.add_argument("--json", action="store_true", help="print the full result as JSON")
    run.set_defaults(func=_cmd_run)

    image = sub.add_parser("image", help="kernel image commands").add_subparsers(dest="image_command", required=True)
    build = image.add_parser("build", help="build the kernel image (no registry needed)")
    build.add_argument("--tag", default=None, help="image tag (default: sandkernel-kernel:<version>)")
    build.add_argument("--base", default=None, help="base image to build on (default: python:3.11-slim or debootstrap)")
    build.add_argument("--offline", action="store_true", help="do not try to pull; use the debootstrapped base")
    build.set_defaults(func=_cmd_image_build)

    from sandkernel.cluster_cli import add_cluster_parser

    add_cluster_parser(sub)

    doctor = sub.add_parser("doctor", help="check Docker, the image, runc and runsc")
    doctor.set_defaults(func=_cmd_doctor)

    spec = sub.add_parser("kernelspec", help="kernelspec commands").add_subparsers(dest="spec_command", required=True)
    install = spec.add_parser("install", help="install sandkernel-python(-gvisor) for Jupyter tools")
    install.add_argument("--user", action="store_true", help="install for the current user only")
    install.add_argument("--prefix", default=None, help="install under this prefix (default: this Python's)")
    install.set_defaults(func=_cmd_kernelspec_install)

    audit = sub.add_parser("audit", help="the gateway's audit stream").add_subparsers(
        dest="audit_command", required=True
    )
    verify = audit.add_parser(
        "verify",
        add_help=False,  # its flags and --help are gateway/audit/verify.py's: handed over untouched
        prefix_chars="\0",
        help="check an audit log's hash chain and name the first record at fault (FILE|DIR ... [--anchor HASH])",
    )
    verify.add_argument("verify_args", nargs="*")
    verify.set_defaults(func=_cmd_audit_verify)

    policy = sub.add_parser("policy", help="the execution policy (serve --exec-policy)").add_subparsers(
        dest="policy_command", required=True
    )
    check = policy.add_parser(
        "check",
        help="validate a policy file and show what it finds in code files (exit 1 if one would be refused)",
    )
    check.add_argument("policy", type=Path, metavar="POLICY", help="the TOML policy file")
    check.add_argument("code", type=Path, nargs="*", metavar="CODE", help="files of cell code to review")
    check.add_argument("--shell", action="store_true", help="review the files as shell commands (the shell door)")
    check.set_defaults(func=_cmd_policy_check)

    reap = sub.add_parser(
        "reap",
        help="remove containers whose sandkernel process died (keeping those recorded for the next gateway)",
    )
    reap.add_argument(
        "--all",
        action="store_true",
        help="remove every sandkernel container, live or not, recorded or not (their sessions are lost)",
    )
    reap.add_argument(
        "--state-dir",
        default=None,
        metavar="DIR",
        help="the gateway's state dir, whose catalog says which sandboxes to keep (default: as sandkernel serve's)",
    )
    reap.set_defaults(func=_cmd_reap)
    return parser


def main(argv: list[str] | None = None) -> int:
    from sandkernel.imports import skip_unused_slow_imports
    from sandkernel.logs import configure

    skip_unused_slow_imports()  # before any command imports nbformat or mcp (imports.py says why)
    args = build_parser().parse_args(argv)
    configure(args.log_level, args.log_format)
    try:
        return args.func(args)
    except SandkernelError as err:
        print(f"sandkernel: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if missing_extra(err) is None:
            raise
        return _missing(err, args.command)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
