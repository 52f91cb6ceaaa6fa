"""The command line, run as a user runs it (a real subprocess, real containers)."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat


def sandkernel(*args: str, stdin: str | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", *args], input=stdin, capture_output=True, text=True, timeout=timeout
    )


def test_help_lists_every_command():
    out = sandkernel("--help").stdout
    for command in ("demo", "run", "image", "doctor", "kernelspec", "reap"):
        assert command in out


def test_doctor_reports_a_ready_machine():
    proc = sandkernel("doctor")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[ok  ] docker engine" in proc.stdout
    assert "[ok  ] kernel image" in proc.stdout
    assert "[ok  ] runtime runc: registered and runs a container" in proc.stdout
    assert "runtime runsc" in proc.stdout


def test_run_prints_the_result_and_json():
    proc = sandkernel("run", "print(6 * 7)")
    assert proc.returncode == 0 and proc.stdout == "42\n"
    proc = sandkernel("run", "--json", "-", stdin="1/0")
    assert proc.returncode == 1
    result = json.loads(proc.stdout)
    assert result["status"] == "error" and result["error"]["name"] == "ZeroDivisionError"


def test_bad_input_gets_a_one_line_error_not_a_traceback():
    proc = sandkernel("run", "--profile", "nope", "1")
    assert proc.returncode == 2
    assert proc.stderr.startswith("sandkernel: unknown profile 'nope'; choose one of")
    assert "Traceback" not in proc.stderr


def test_demo_does_real_work_and_leaves_a_valid_notebook(tmp_path):
    path = tmp_path / "demo.ipynb"
    proc = sandkernel("demo", "--notebook", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2025Q4" in proc.stdout and "interfaces: ['lo']" in proc.stdout
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    assert len(code_cells) == 4 and all(c.metadata["sandkernel"]["status"] == "ok" for c in code_cells)
    assert any("image/png" in o.get("data", {}) for c in code_cells for o in c.outputs)
