"""sandkernel.gateway (see the issues for what lands here)."""
