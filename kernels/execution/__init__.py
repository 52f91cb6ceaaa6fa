"""Executions: the session that owns one sandboxed kernel, and the outputs an execution returns."""
