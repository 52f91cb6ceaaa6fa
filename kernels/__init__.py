"""The session layer: sandboxed kernels and the one execution path every door goes through.

Subpackages, by concern:

- ``sandbox``: the container and its hardening (Docker provisioner, seccomp allow-list, per-sandbox
  uids, the locked runtime dir, the image, workspace files, kernelspecs, the host doctor);
- ``egress``: the operator's network allow-list and the per-session proxy that enforces it;
- ``execution``: :class:`~sandkernel.kernels.execution.session.KernelSession`, its serialised,
  bounded execute (the timeout ladder, OOM and death classification, output budgets) and the
  events it tells the layers above;
- ``lifecycle``: profiles, the operator's catalog, the warm pool, the reaper.

This package imports nothing from ``notebooks``, ``gateway`` or ``agent`` (tests/test_import_rules.py):
the layers above attach observers to sessions instead of being called from here.
"""
