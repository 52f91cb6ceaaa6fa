"""The built-in rules: their names (the API an operator writes in the policy file) and the message
each gives by default, written for a model so it can rewrite the code rather than retry it.

A message may say ``{writable}``: it is replaced with the policy's writable directories. What
each rule matches is in python_review.py (cells) and shell_review.py (shell lines).
"""

from __future__ import annotations

SUBPROCESS = "subprocess"
OS_SYSTEM = "os_system"
RAW_SOCKET = "raw_socket"
CTYPES = "ctypes"
WRITE_OUTSIDE_WORKSPACE = "write_outside_workspace"
PATH_TRAVERSAL = "path_traversal"
SHELL = "shell"
DYNAMIC_CODE = "dynamic_code"
PACKAGE_INSTALL = "package_install"
UNREVIEWED = "unreviewed"  # a cell too long for the review to read (policy.MAX_REVIEW_CHARS)

MESSAGES: dict[str, str] = {
    SUBPROCESS: (
        "Starting external programs (subprocess, os.popen, os.exec*, os.spawn*, pty.spawn, "
        "asyncio subprocesses) is against this sandbox's code policy. Rewrite the code to do "
        "the work in Python itself (pathlib, shutil, glob, pandas, the standard library) instead of "
        "running a program."
    ),
    OS_SYSTEM: (
        "os.system runs a shell command, which is against this sandbox's code policy. Rewrite "
        "the code to do the work in Python itself (pathlib, shutil, glob, os.listdir) instead of "
        "through a shell."
    ),
    RAW_SOCKET: (
        "Opening network sockets directly (the socket module) is against this sandbox's "
        "code policy. Rewrite the code without low-level networking; the sandbox may have no "
        "network at all, so work with the files in /workspace."
    ),
    CTYPES: (
        "Loading native code with ctypes or cffi is against this sandbox's code policy. "
        "Rewrite the code with pure Python or the installed libraries (numpy, pandas) instead."
    ),
    WRITE_OUTSIDE_WORKSPACE: (
        "Writing outside the workspace is against this sandbox's code policy; code should "
        "write only under {writable}. Rewrite the code to write under /workspace (a relative path "
        "such as 'out/result.csv' is under /workspace)."
    ),
    PATH_TRAVERSAL: (
        "Paths with '..' climb out of the directory they start from, which is against this sandbox's "
        "code policy. Rewrite the code with paths written without '..': relative to "
        "/workspace (such as 'data/input.csv') or absolute under /workspace."
    ),
    SHELL: (
        "Shell commands (!cmd, %system, %%bash, %%sh, %%script, the shell endpoint) are "
        "against this sandbox's code policy. Rewrite the step in Python: pathlib, os and shutil "
        "for files, glob for listings, open() to read and write."
    ),
    DYNAMIC_CODE: (
        "Running code built at run time (eval, exec, compile, __import__ or "
        "importlib.import_module of a computed name) is against this sandbox's code "
        "policy. Rewrite it as plain Python statements, with the imports written out."
    ),
    PACKAGE_INSTALL: (
        "Installing or removing packages (%pip, %conda, pip, conda, apt) is against this "
        "sandbox's code policy. Rewrite the code with the packages already installed (pandas, "
        "numpy, matplotlib and the standard library)."
    ),
    UNREVIEWED: (
        "Cells this long are not reviewed by this sandbox's code policy. Rewrite it as shorter "
        "cells, and put long data in a file (upload it) instead of pasting it into code."
    ),
}

RULE_NAMES: tuple[str, ...] = tuple(MESSAGES)
