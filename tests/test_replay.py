"""Replay never crashes: notebooks sandkernel did not write, as a new user would try them.

Each notebook is written here the way Jupyter (or an older Jupyter, or a hand) saves it, then
replayed in a real sandbox through ``run_replay_command`` (the body of ``sandkernel replay``),
and must give each code cell the right verdict, the documented exit code, and a replay that
validates. Kernel deaths, endless cells, widget notebooks, nbformat 3 files, a kernelspec with
no name, schema-invalid metadata and outputs are all cases a public notebook brings.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbformat import v3

from sandkernel.notebooks.compare import EXIT_BAD_INPUT, EXIT_DIFFERENT, EXIT_SAME
from sandkernel.notebooks.replay import run_replay_command

from .conftest import RUNTIME_PARAMS, require_runtime

EXAMPLES = Path(__file__).resolve().parents[1] / "notebooks" / "examples"


def stream(text: str, name: str = "stdout") -> dict:
    return {"output_type": "stream", "name": name, "text": [text]}


def result(count: int, plain: str, **more: object) -> dict:
    return {
        "output_type": "execute_result",
        "execution_count": count,
        "metadata": {},
        "data": {"text/plain": [plain], **more},
    }


def code(count: int | None, source: str, outputs: list[dict], metadata: dict | None = None) -> dict:
    """A code cell as Jupyter before nbformat 4.5 saved it: no id, source as a list of lines."""
    lines = source.splitlines(keepends=True)
    return {
        "cell_type": "code",
        "execution_count": count,
        "metadata": metadata or {},
        "outputs": outputs,
        "source": lines,
    }


def public_notebook(cells: list[dict], metadata: dict | None = None, minor: int = 2) -> dict:
    """nbformat 4.2, as countless notebooks on the web are; the kernelspec has no name."""
    meta = {"kernelspec": {"display_name": "Python 3"}} if metadata is None else metadata
    return {"nbformat": 4, "nbformat_minor": minor, "metadata": meta, "cells": cells}


def replay(path: Path, **options: object) -> tuple[int, str, str, nbformat.NotebookNode | None]:
    """Replay ``path`` (runc unless told); exit code, stdout, stderr and the replay notebook."""
    out, err = io.StringIO(), io.StringIO()
    options.setdefault("runtime", "runc")
    code = run_replay_command(str(path), out=out, err=err, **options)
    target = path.with_name(path.name.removesuffix(".ipynb") + ".replay.ipynb")
    replayed = None
    if target.exists():
        replayed = nbformat.read(target, as_version=4)
        nbformat.validate(replayed)  # raises if the replay is not a valid notebook
    return code, out.getvalue(), err.getvalue(), replayed


def verdicts_of(stdout: str) -> list[str]:
    return [line.split(": ", 1)[1].split(" (")[0] for line in stdout.splitlines() if line.startswith("cell ")]


def write(tmp_path: Path, name: str, notebook: dict) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(notebook))
    return path


@pytest.mark.docker
def test_public_notebook_with_odd_metadata_replays_to_a_valid_notebook(tmp_path):
    """No kernelspec name (the old replay ran it, then died writing: NotebookValidationError),
    no language_info, no cell ids, cell metadata and an output the schema rejects."""
    nb = public_notebook(
        [
            {"cell_type": "markdown", "metadata": {}, "source": ["# Squares\n", "A public notebook."]},
            code(1, "squares = [n * n for n in range(5)]\nprint(squares)", [stream("[0, 1, 4, 9, 16]\n")]),
            code(2, "sum(squares)", [result(2, "30")], metadata={"collapsed": "yes", "tags": ["total"]}),
            code(3, "print('done')", [{"output_type": "pyout-from-a-plugin", "x": 1}, stream("done\n")]),
        ]
    )
    path = write(tmp_path, "squares.ipynb", nb)
    code_, stdout, stderr, replayed = replay(path)
    assert "Traceback" not in stdout + stderr
    assert verdicts_of(stdout) == ["same", "same", "same"], stdout
    assert code_ == EXIT_SAME
    assert "metadata.kernelspec has no name (display name 'Python 3')" in stdout
    assert "assumed Python" in stdout and "cells had no id" in stdout
    assert "an output of unknown type 'pyout-from-a-plugin'" in stdout
    assert "code cell 2: the notebook schema rejected it" in stdout and "left out: metadata" in stdout
    assert "3 of 3 code cells the same" in stdout
    assert replayed.metadata.kernelspec.name == "sandkernel-python" and replayed.nbformat_minor == 5
    assert len({cell.id for cell in replayed.cells}) == len(replayed.cells) == 4
    assert [c.metadata["sandkernel"]["replay_verdict"] for c in replayed.cells[1:]] == ["same"] * 3
    assert replayed.cells[2].metadata["sandkernel"]["status"] == "ok" and "tags" not in replayed.cells[2].metadata
    assert replayed.cells[0].source == "# Squares\nA public notebook."
    assert replayed.metadata.sandkernel.replay["of"] == "squares.ipynb"


@pytest.mark.docker
def test_an_output_the_schema_rejects_does_not_stop_the_replay(tmp_path):
    """Kernel output is untrusted: text/plain that is not text (it raised NotebookValidationError
    out of session.execute until the collector coerced it) leaves the replay going and valid."""
    nb = public_notebook(
        [
            code(1, "from IPython.display import publish_display_data\npublish_display_data({'text/plain': 5})", []),
            code(2, "print('next')", [stream("next\n")]),
        ]
    )
    code_, stdout, stderr, replayed = replay(write(tmp_path, "malformed.ipynb", nb))
    assert "Traceback" not in stderr
    assert verdicts_of(stdout) == ["changed", "same"], stdout + stderr
    assert code_ == EXIT_DIFFERENT and replayed is not None


@pytest.mark.docker
def test_a_cell_that_kills_its_kernel_is_judged_and_the_rest_continue(tmp_path):
    """Through the real CLI: the old replay ended in a DeadKernelError traceback and every
    replay printed a "Could not destroy zmq context" warning."""
    nb = public_notebook(
        [
            code(1, "x = 41", []),
            code(2, "import os\nos.kill(os.getpid(), 9)", []),
            code(3, "print('alive')", [stream("alive\n")]),
            code(4, "x + 1", [result(4, "42")]),
        ]
    )
    path = write(tmp_path, "suicide.ipynb", nb)
    proc = subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", "replay", str(path), "--runtime", "runc"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == EXIT_DIFFERENT, proc.stdout + proc.stderr
    assert verdicts_of(proc.stdout) == ["same", "kernel died", "same", "new error"], proc.stdout
    assert "cell 2: kernel died (the kernel process ended; the next cell runs on a restarted kernel)" in proc.stdout
    assert (
        "cell 4: new error (kernel state lost at cell 2: the kernel died during this execution and was restarted"
        in proc.stdout
    )
    assert "Traceback" not in proc.stderr and "DeadKernelError" not in proc.stdout + proc.stderr
    assert "Could not destroy zmq context" not in proc.stderr, proc.stderr
    replayed = nbformat.read(tmp_path / "suicide.replay.ipynb", as_version=4)
    nbformat.validate(replayed)
    statuses = [c.metadata["sandkernel"]["status"] for c in replayed.cells]
    assert statuses == ["ok", "kernel_died", "ok", "error"]


@pytest.mark.docker
def test_an_endless_cell_times_out_and_the_replay_goes_on(tmp_path):
    """The per-cell timeout climbs the session's ladder: an interrupt ends a plain loop (state
    kept); a loop that ignores SIGINT needs a restart (state lost, said so)."""
    nb = public_notebook(
        [
            code(1, "total = 0", []),
            code(2, "while True:\n    total += 1", []),
            code(3, "print(total > 0)", [stream("True\n")]),
            code(4, "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", []),
            code(5, "print('after')", [stream("after\n")]),
            code(6, "print(total > 0)", [stream("True\n")]),
        ]
    )
    path = write(tmp_path, "forever.ipynb", nb)
    code_, stdout, stderr, replayed = replay(path, timeout=3)
    assert code_ == EXIT_DIFFERENT, stdout + stderr
    assert verdicts_of(stdout) == ["same", "timed out", "same", "timed out", "same", "new error"], stdout
    assert "cell 2: timed out (still running after 3s; stopped by interrupt)" in stdout
    assert "cell 4: timed out (still running after 3s; stopped by restart)" in stdout
    assert (
        "cell 6: new error (kernel state lost at cell 4: the kernel was restarted because the execution exceeded"
        in stdout
    )
    ended = [c.metadata["sandkernel"]["ended_by"] for c in replayed.cells]
    assert ended == [None, "interrupt", None, "restart", None, None]


@pytest.mark.docker
def test_a_recorded_death_replayed_is_not_a_difference(tmp_path):
    """A sandkernel transcript records each cell's status: a replay that dies where the
    original died reproduces it (exit 0), and says so."""
    nb = public_notebook(
        [
            code(1, "import os\nos.kill(os.getpid(), 9)", [], metadata={"sandkernel": {"status": "kernel_died"}}),
            code(2, "print('again')", [stream("again\n")]),
        ],
        metadata={"kernelspec": {"name": "sandkernel-python", "display_name": "x", "language": "python"}},
        minor=5,
    )
    for i, cell in enumerate(nb["cells"]):
        cell["id"] = f"c{i}"
    code_, stdout, stderr, _ = replay(write(tmp_path, "died.ipynb", nb))
    assert code_ == EXIT_SAME, stdout + stderr
    assert (
        "cell 1: kernel died (the kernel process ended; the next cell runs on a restarted kernel; as in the original)"
        in stdout
    )


@pytest.mark.docker
def test_widget_notebook_replays_the_same(tmp_path):
    """ipywidgets and tqdm.notebook are in the image (without them these cells raised
    ModuleNotFoundError); a widget's saved view names a model that does not exist any more, so
    the original's widget state is not copied, and only the text form is compared."""
    view = {"application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0, "model_id": "f" * 32}}
    nb = public_notebook(
        [
            code(
                1, "import ipywidgets as widgets\nwidgets.IntSlider(value=3)", [result(1, "IntSlider(value=3)", **view)]
            ),
            code(
                2,
                "from tqdm.notebook import tqdm\ntotal = 0\nfor i in tqdm(range(5)):\n    total += i\nprint(total)",
                [
                    {
                        "output_type": "display_data",
                        "metadata": {},
                        "data": {"text/plain": ["  0%|          | 0/5 [00:00<?, ?it/s]"], **view},
                    },
                    stream("10\n"),
                ],
            ),
            code(
                3,
                "from IPython.display import display\ndisplay(widgets.Button(description='Go'))",
                [
                    {
                        "output_type": "display_data",
                        "metadata": {},
                        "data": {"text/plain": ["Button(description='Go', style=ButtonStyle())"], **view},
                    },
                ],
            ),
        ],
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
            "language_info": {"name": "python", "version": "3.11.4"},
            "widgets": {
                "application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2, "version_minor": 0}
            },
        },
        minor=4,
    )
    code_, stdout, stderr, replayed = replay(write(tmp_path, "widgets.ipynb", nb))
    assert code_ == EXIT_SAME, stdout + stderr
    assert verdicts_of(stdout) == ["same", "same", "same"]
    assert "widget state (metadata.widgets) was not copied" in stdout
    assert "widgets" not in replayed.metadata
    assert "application/vnd.jupyter.widget-view+json" in replayed.cells[0].outputs[0]["data"]


@pytest.mark.docker
def test_nbformat_3_notebook_is_converted_and_replayed(tmp_path):
    nb = v3.new_notebook(
        worksheets=[
            v3.new_worksheet(
                cells=[
                    v3.new_heading_cell("Old notebook", level=1),
                    v3.new_code_cell(
                        input="print('hi')", outputs=[v3.new_output("stream", output_text="hi\n", stream="stdout")]
                    ),
                    v3.new_code_cell(
                        input="6 * 7", outputs=[v3.new_output("pyout", output_text="42", prompt_number=2)]
                    ),
                    v3.new_code_cell(
                        input="1 / 0",
                        outputs=[
                            v3.new_output("pyerr", ename="ZeroDivisionError", evalue="division by zero", traceback=[])
                        ],
                    ),
                    v3.new_code_cell(
                        input="print('gone')", outputs=[v3.new_output("pyerr", ename="NameError", evalue="x")]
                    ),
                ]
            )
        ],
        metadata=v3.new_metadata(name="old"),
    )
    path = tmp_path / "old.ipynb"
    path.write_text(nbformat.writes(nb, version=3))
    assert json.loads(path.read_text())["nbformat"] == 3
    code_, stdout, stderr, replayed = replay(path)
    assert verdicts_of(stdout) == ["same", "same", "same", "error gone"], stdout + stderr
    assert code_ == EXIT_DIFFERENT
    assert "converted from nbformat 3.0 to 4.5" in stdout
    assert replayed.cells[0].cell_type == "markdown" and replayed.cells[0].source == "# Old notebook"


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json at all", "is not a notebook nbformat can read"),
        ('{"nbformat": 9, "cells": []}', "is not a notebook nbformat can read: Unsupported nbformat version 9"),
        ("[1, 2]", "is not a notebook nbformat can read"),
        (
            json.dumps(
                public_notebook(
                    [code(1, "x <- c(1, 2)", [])],
                    metadata={"kernelspec": {"name": "ir", "display_name": "R", "language": "R"}},
                )
            ),
            "is a R notebook (kernel ir); sandkernel runs Python only",
        ),
    ],
)
def test_bad_input_is_refused_before_any_sandbox(tmp_path, content, message):
    path = tmp_path / "bad.ipynb"
    path.write_text(content)
    code_, _, stderr, replayed = replay(path)
    assert code_ == EXIT_BAD_INPUT and message in stderr, stderr
    assert "Traceback" not in stderr and replayed is None


def test_bad_arguments_are_refused(tmp_path):
    path = write(tmp_path, "ok.ipynb", public_notebook([code(1, "1", [])]))
    assert replay(tmp_path / "missing.ipynb")[0] == EXIT_BAD_INPUT
    code_, _, stderr, _ = replay(path, until=-1)
    assert code_ == EXIT_BAD_INPUT and "--until must be" in stderr
    code_, _, stderr, _ = replay(path, timeout=0)
    assert code_ == EXIT_BAD_INPUT and "--timeout must be seconds per cell" in stderr
    code_, _, stderr, _ = replay(path, profile="enormous")
    assert code_ == EXIT_BAD_INPUT and "unknown profile 'enormous'" in stderr
    rules = tmp_path / "rules.json"
    rules.write_text('[["(unclosed", "x"]]')
    code_, _, stderr, _ = replay(path, rules_file=str(rules))
    assert code_ == EXIT_BAD_INPUT and "not a regular expression" in stderr


@pytest.mark.parametrize("runtime", RUNTIME_PARAMS)
def test_existing_transcripts_replay_the_same(tmp_path, runtime):
    """sandkernel's own recorded sessions (an analysis with a chart and uploaded data; an error
    and its fix) reproduce every cell, under both runtimes."""
    require_runtime(runtime)
    for name in ("sales-demo.ipynb", "error-recovery.ipynb"):
        shutil.copy(EXAMPLES / name, tmp_path / name)
        cells = [c for c in nbformat.read(EXAMPLES / name, as_version=4).cells if c.cell_type == "code"]
        code_, stdout, stderr, replayed = replay(tmp_path / name, runtime=runtime)
        assert code_ == EXIT_SAME, stdout + stderr
        assert verdicts_of(stdout) == ["same"] * len(cells)
        assert f"{len(cells)} of {len(cells)} code cells the same" in stdout
        assert f"replayed notebook ({runtime})" in stdout
        assert replayed.metadata.sandkernel.runtime == runtime
        assert not [line for line in stdout.splitlines() if line.startswith("note:")], stdout


@pytest.mark.docker
def test_until_leaves_later_cells_not_run(tmp_path):
    shutil.copy(EXAMPLES / "error-recovery.ipynb", tmp_path / "e.ipynb")
    code_, stdout, stderr, replayed = replay(tmp_path / "e.ipynb", until=2)
    assert code_ == EXIT_SAME, stdout + stderr
    assert verdicts_of(stdout) == ["same", "same", "not run", "not run"]
    unrun = [c for c in replayed.cells if c.cell_type == "code"][2:]
    assert all(c.outputs == [] and c.execution_count is None for c in unrun)


@pytest.mark.docker
def test_a_cell_refused_when_recorded_is_not_run(tmp_path):
    """A gate (the execution policy, a quarantine) refused the cell in the original session: it
    never ran then, so the replay does not run it now (its code could even be harmful)."""
    refusal = {"by": "policy", "rule": "subprocess", "message": "Starting programs is against this sandbox's policy."}
    refused_output = {
        "output_type": "error",
        "ename": "ExecutionRefused",
        "evalue": refusal["message"],
        "traceback": [refusal["message"]],
    }
    nb = public_notebook(
        [
            code(1, "x = 2\nprint(x)", [stream("2\n")]),
            code(
                None,
                "import os\nos.remove('canary.txt')",
                [refused_output],
                metadata={"sandkernel": {"status": "refused", "refusal": refusal}},
            ),
            code(2, "import os\nprint(os.path.exists('canary.txt') or 'no canary')", [stream("no canary\n")]),
        ]
    )
    code_, stdout, stderr, replayed = replay(write(tmp_path, "refused.ipynb", nb))
    assert verdicts_of(stdout) == ["same", "not run", "same"], stdout + stderr
    assert "refused when recorded" in stdout
    assert code_ == EXIT_SAME
    unrun = [c for c in replayed.cells if c.cell_type == "code"][1]
    assert unrun.outputs == [] and unrun.metadata["sandkernel"]["replay_verdict"] == "not run"
