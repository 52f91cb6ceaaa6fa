"""The bottom of sandkernel.kernels: what a sandbox is asked to be and what is recorded of it.

``profiles`` (the profiles, every setting's range and default) and ``records`` (a sandbox's
catalog record). Plain data and its checks: these modules import no other kernels sub-package
but egress's policy (a profile's network setting), so every other one may import them.
"""
