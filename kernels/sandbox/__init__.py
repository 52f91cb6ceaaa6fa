"""The sandbox: one hardened container per kernel and the host-side pieces that make it safe.

The Docker provisioner (jupyter_client's provisioner API), the container's hardening (seccomp
allow-list, per-sandbox uids, the locked runtime dir), the Docker boundary, the kernel image,
files in the workspace, kernelspecs and the host doctor. Nothing here knows about executions.
"""
