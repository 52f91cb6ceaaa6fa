"""Snapshots of a session: its files archived from inside the sandbox, a signed manifest, and the
replay that rebuilds its memory."""
