"""sandkernel.notebooks (see the issues for what lands here)."""
