"""Uploads into /workspace (kernels/sandbox/workspace_files.py) against a real container: replaced
atomically through a temp file of a random name, which neither a planted file nor a failed upload
can block, and refused with a clear error code instead of a traceback."""

from __future__ import annotations

import pytest

from sandkernel.kernels.sandbox.workspace_files import WorkspaceFileError, WorkspaceFiles

pytestmark = pytest.mark.docker


async def test_a_planted_temp_name_does_not_block_an_upload(kernel_session):
    files = WorkspaceFiles(kernel_session.container)
    await kernel_session.execute("open('data.csv.sandkernel-upload', 'w').write('planted')")  # the old fixed temp name
    assert (await files.write("data.csv", b"a,b\n"))["size"] == 4
    assert await files.read("data.csv") == b"a,b\n"


async def test_a_failed_upload_names_the_problem_and_leaves_nothing(kernel_session):
    files = WorkspaceFiles(kernel_session.container)
    await files.write("plain.txt", b"x")
    with pytest.raises(WorkspaceFileError) as refused:
        await files.write("plain.txt/inner.txt", b"y")  # the parent is a file
    assert refused.value.code == "bad_path"
    names = {entry["name"] for entry in await files.list("")}
    assert not any(name.endswith(".sandkernel-upload") for name in names - {"data.csv.sandkernel-upload"})
