"""sandkernel: sandboxed, stateful Jupyter kernels for AI agents."""

__version__ = "0.1.0"
