"""Exit codes of ``sandkernel replay`` and ``sandkernel diff`` (3 is replay's only).

A module of its own, importing nothing, so the CLI can print them in ``--help`` without
loading nbformat (about 2 s on a cold start).
"""

EXIT_SAME, EXIT_DIFFERENT, EXIT_BAD_INPUT, EXIT_SANDBOX_FAILED = 0, 1, 2, 3
EXIT_CODES = {
    EXIT_SAME: "every code cell agrees (same, not run, or a death or timeout the original recorded too)",
    EXIT_DIFFERENT: "at least one code cell differs (changed, new error, error gone, kernel died, timed out, missing)",
    EXIT_BAD_INPUT: "bad input: no notebook, not one nbformat reads, not Python, a needed file or setting missing",
    EXIT_SANDBOX_FAILED: "the sandbox could not run the replay (Docker, the image, the runtime, the kernel)",
}
