"""Which recorded cells a kernel's memory holds (notebooks/resume.py ``cells_in_memory``): what a
pause, fork or checkpoint replays. Issue 30, item 3: the walk copied the live list at every cell
(quadratic: about 6 GB for 40,000 cells); it now shares what came before."""

from __future__ import annotations

import tracemalloc

import nbformat

from sandkernel.notebooks.resume import cells_in_memory


def code(**recorded) -> nbformat.NotebookNode:
    return nbformat.v4.new_code_cell("x", metadata={"sandkernel": recorded} if recorded else {})


def rewind(to: int) -> nbformat.NotebookNode:
    return nbformat.v4.new_markdown_cell("rewound", metadata={"sandkernel": {"rewind": {"to": to}}})


def notebook(*cells) -> nbformat.NotebookNode:
    return nbformat.v4.new_notebook(cells=list(cells))


def test_deaths_restarts_refusals_and_rewinds_shape_what_memory_holds():
    nb = notebook(
        code(),  # 1
        code(status="ok"),  # 2
        code(status="refused"),  # 3: never ran
        code(status="kernel_died", state_lost="died"),  # 4: nothing left
        code(state_lost="died before it"),  # 5: ran on the fresh kernel
        code(),  # 6
        code(status="timeout", ended_by="restart", state_lost="restarted"),  # 7: replaced
        code(state_lost="restarted before it"),  # 8
        code(),  # 9
        rewind(6),  # back to the state right after cell 6
        code(),  # 10
    )
    assert cells_in_memory(nb) == [5, 6, 10]
    assert cells_in_memory(nb, after=2) == [1, 2]
    assert cells_in_memory(nb, after=3) == [1, 2]
    assert cells_in_memory(nb, after=4) == []
    assert cells_in_memory(nb, after=9) == [8, 9]
    assert cells_in_memory(nb, lost_since=True) == []
    assert cells_in_memory(nb, after=6, lost_since=True) == [5, 6]  # only the end is lost
    assert cells_in_memory(notebook(code(), rewind(7), code())) == [1, 2]  # a rewind to no cell: ignored


def test_fifty_thousand_cells_take_linear_memory():
    """The result's own size is what the walk needs, not the square of the transcript's length
    (a copied list per cell held 50,000 x 25,000 ints, about 10 GB here)."""
    n = 50_000
    nb = nbformat.NotebookNode(cells=[{"cell_type": "code", "metadata": {}} for _ in range(n)])
    tracemalloc.start()
    try:
        cells = cells_in_memory(nb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert cells == list(range(1, n + 1))
    assert peak < 64 * n * 20, peak  # well under 64 MB: a few pointers per cell
