"""The files a Swarm deployment is made of, as shipped with the package: the stack file.

One place for the stack file's text (package data next to the gateway image's Dockerfile), so
`sandkernel cluster stack`, `sandkernel cluster up` and the tests deploy the same file.
"""

from __future__ import annotations

import importlib.resources

STACK_FILE = "stack.yml"
STACK_SERVICE = "gateway"  # the service's name inside the stack file
SECRET_NAMES = {  # the stack's external Docker secrets -> what each holds
    "sandkernel_catalog_url": "the postgresql:// URL of the cluster catalog (with its password)",
    "sandkernel_cluster_secret": "the secret the gateways sign forwarded requests with (32+ bytes)",
    "sandkernel_tokens": 'the tenants\' tokens file, JSON {"tenant": "token"}',
}


def stack_text() -> str:
    """The stack file for ``docker stack deploy`` (the gateway as a global service)."""
    return importlib.resources.files("sandkernel.gateway.cluster").joinpath("image", STACK_FILE).read_text()
