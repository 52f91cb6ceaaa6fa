"""sandkernel.agent (see the issues for what lands here)."""
