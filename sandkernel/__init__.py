"""sandkernel: sandboxed, stateful Jupyter kernels for AI agents.

The modules directly in this package are the common base every layer may import (errors, mime,
truncation, atomic, output_text, logs) and the CLI layer on top (cli, demo, local_gateway). The
layers are the subpackages kernels ← notebooks ← gateway ← agent.
"""

__version__ = "0.1.0"
