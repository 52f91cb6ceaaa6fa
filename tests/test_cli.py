"""The command line, run as a user runs it (a real subprocess, real containers)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import nbformat
import pytest


def sandkernel(
    *args: str, stdin: str | None = None, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def test_help_lists_every_command():
    out = sandkernel("--help").stdout
    for command in ("demo", "agent", "run", "image", "doctor", "kernelspec", "reap"):
        assert command in out


@pytest.mark.docker
def test_doctor_reports_a_ready_machine():
    proc = sandkernel("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok  ] docker engine" in proc.stdout
    assert "[ok  ] kernel image" in proc.stdout
    assert "[ok  ] runtime runc: registered and runs a container" in proc.stdout
    assert "runtime runsc" in proc.stdout
    if os.environ.get("SANDKERNEL_REQUIRE_RUNSC") == "1":  # CI: host-setup put runsc's wrapper in place
        assert "[ok  ] memory snapshots: gVisor 20240729, through sandkernel's wrapper" in proc.stdout


@pytest.mark.smoke  # the quick tier's check of this door (scripts/test.sh --quick)
@pytest.mark.docker
def test_run_prints_the_result_and_json():
    proc = sandkernel("run", "print(6 * 7)")
    assert proc.returncode == 0 and proc.stdout == "42\n"
    proc = sandkernel("run", "--json", "-", stdin="1/0")
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["status"] == "error" and result["error"]["name"] == "ZeroDivisionError"


@pytest.mark.docker
def test_bad_input_gets_a_one_line_error_not_a_traceback():
    proc = sandkernel("run", "--profile", "nope", "1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("sandkernel: unknown profile 'nope'; choose one of")
    assert "Traceback" not in proc.stderr


@pytest.mark.docker
def test_demo_runs_the_sales_agent_offline_and_leaves_a_valid_notebook(tmp_path):
    path = tmp_path / "demo.ipynb"
    proc = sandkernel(
        "demo", "--notebook", str(path), "--workdir", str(tmp_path / "work"), env={"ANTHROPIC_API_KEY": ""}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("ANTHROPIC_API_KEY is not set: playing a scripted conversation")
    assert "→ run_python" in proc.stdout and "The best quarter was **2025Q4**" in proc.stdout
    assert f"notebook: {path}" in proc.stdout
    assert (tmp_path / "work" / "report.png").read_bytes().startswith(b"\x89PNG")
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code_cells) == 3 and all(c.metadata["sandkernel"]["status"] == "ok" for c in code_cells)
    assert all(c.metadata["sandkernel"]["tag"].startswith("toolu_") for c in code_cells)
    assert any("image/png" in o.get("data", {}) for c in code_cells for o in c.outputs)


def test_agent_without_an_api_key_says_what_to_set():
    proc = sandkernel("agent", "count rows", env={"ANTHROPIC_API_KEY": "", "ANTHROPIC_AUTH_TOKEN": ""})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "ANTHROPIC_API_KEY is not set" in proc.stderr and "export ANTHROPIC_API_KEY=" in proc.stderr


def test_agent_help_reads_well():
    out = sandkernel("agent", "--help").stdout
    for phrase in (
        "Run TASK with Claude",
        "--file PATH",
        "--notebook PATH",
        "--model NAME",
        "example: sandkernel agent",
    ):
        assert phrase in out


@pytest.mark.docker
async def test_agent_cli_end_to_end_against_the_scripted_api(tmp_path):
    """The CLI as a user runs it, the real SDK reaching the scripted server through ANTHROPIC_BASE_URL."""
    import asyncio

    from sandkernel.agent.offline_api import ScriptedMessagesServer
    from sandkernel.agent.scenarios import LOG_FILES, SCENARIOS

    scenario = SCENARIOS["logs"]
    [folder] = scenario.make_files(tmp_path)
    async with ScriptedMessagesServer(scenario.turns()) as server:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sandkernel.cli",
            "agent",
            scenario.task,
            "--file",
            str(folder),
            "--notebook",
            str(tmp_path / "logs.ipynb"),
            "--download",
            "error_summary.csv",
            cwd=tmp_path,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "ANTHROPIC_API_KEY": "test-key", "ANTHROPIC_BASE_URL": server.url},
        )
        out, err = (part.decode() for part in await asyncio.wait_for(proc.communicate(), 300))
    assert proc.returncode == 0, out + err
    assert f"uploaded to the workspace: {', '.join('logs/' + n for n in sorted(LOG_FILES))}" in out
    assert "✗ error" in out and "✓ ok" in out and "stopped: answer after 3 turns, 2 tool calls" in out
    assert "Saved as error_summary.csv" in out and f"notebook: {tmp_path / 'logs.ipynb'}" in out
    assert "error_lines" in (tmp_path / "error_summary.csv").read_text()
    nbformat.validate(nbformat.read(tmp_path / "logs.ipynb", as_version=4))


def test_policy_check_validates_the_file_and_shows_what_it_would_refuse(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('default = "allow"\n[rules]\nsubprocess = "deny"\nos_system = "warn"\n')
    cell = tmp_path / "cell.py"
    cell.write_text("import os\nos.system('ls')\n")
    warned = sandkernel("policy", "check", str(policy), str(cell))
    assert warned.returncode == 0, warned.stdout + warned.stderr
    assert "warn  os_system (line 2)" in warned.stdout
    cell.write_text("x = 1\nimport subprocess\n")
    refused = sandkernel("policy", "check", str(policy), str(cell))
    assert refused.returncode == 1 and "deny  subprocess (line 2)" in refused.stdout


def test_policy_check_names_the_line_of_a_bad_rule(tmp_path):
    policy = tmp_path / "policy.toml"
    policy.write_text('default = "warn"\n\n[rules]\nsubproces = "deny"\n')
    proc = sandkernel("policy", "check", str(policy))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "line 4" in proc.stderr and "unknown rule 'subproces'" in proc.stderr


def test_audit_verify_hands_its_flags_to_the_verifier(tmp_path):
    assert "--anchor HASH" in sandkernel("audit", "verify", "--help").stdout
    missing = sandkernel("audit", "verify", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "cannot read the audit log" in missing.stderr
