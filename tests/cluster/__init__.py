"""The swarm lab: several Docker engines on this machine, each in its own network namespace (issue 18).

:mod:`.lab` builds and tears it down (with :mod:`.network` and :mod:`.traces`, what of it exists
on the machine); :mod:`.fixtures` holds the ``swarm_lab`` pytest fixture. docs/cluster-lab.md
says how and why.
"""

from .commands import LabError
from .lab import BASE_IMAGE, KERNEL_IMAGE, LAB_NET, RUNSC_LABEL, SWITCH_NET, Lab, LabHost, main_runtimes, running_lab

__all__ = ["BASE_IMAGE", "KERNEL_IMAGE", "LAB_NET", "RUNSC_LABEL", "SWITCH_NET", "Lab", "LabError", "LabHost",
           "main_runtimes", "running_lab"]
