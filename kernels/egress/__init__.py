"""Network egress of a sandbox: the operator's allow-list policy and the per-session proxy that enforces it."""
