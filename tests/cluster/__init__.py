"""The swarm lab: several Docker engines on this machine, each in its own network namespace (issue 18)."""

from .lab import BASE_IMAGE, KERNEL_IMAGE, LAB_NET, RUNSC_LABEL, SWITCH_NET, Lab, LabError, LabHost, running_lab

__all__ = ["BASE_IMAGE", "KERNEL_IMAGE", "LAB_NET", "RUNSC_LABEL", "SWITCH_NET", "Lab", "LabError", "LabHost",
           "running_lab"]
