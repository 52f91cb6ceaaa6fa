"""The swarm lab's network: a bridge in a "switch" namespace, a veth into each host's namespace,
and one veth from the root namespace, all on a private /24 with no route anywhere else.

Nothing here touches the root namespace's routes or iptables: the root end of its veth gets an
address (so the kernel adds the connected route to the lab's /24 on that veth, and nothing
more), IPv4 forwarding switched off for whatever arrives on it (a lab namespace that added a
route through it still could not be forwarded anywhere), and no IPv6. The hosts' namespaces get
no default route, so a connect() to anything outside the lab fails in the route lookup
(ENETUNREACH) before a packet exists.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from .commands import run


def build(switch_ns: str, hosts: Sequence[tuple[str, str]], root_veth: str, root_ip: str,
          lan: ipaddress.IPv4Network) -> None:
    """Create the switch namespace with bridge ``br0``; for each ``(netns, ip)`` of ``hosts`` the
    namespace, ``lo`` up and an ``eth0`` on the bridge with ``ip``; and the root namespace's
    ``root_veth`` with ``root_ip``. Names and addresses are the caller's; LabError on a failure."""
    steps: list[list[str]] = [
        ["ip", "netns", "add", switch_ns],
        ["ip", "-n", switch_ns, "link", "set", "lo", "up"],
        ["ip", "-n", switch_ns, "link", "add", "br0", "type", "bridge"],
        ["ip", "-n", switch_ns, "link", "set", "br0", "up"],
    ]
    for index, (ns, ip) in enumerate(hosts, start=1):
        port = f"h{index}"
        steps += [
            ["ip", "netns", "add", ns],
            ["ip", "-n", ns, "link", "set", "lo", "up"],
            ["ip", "-n", switch_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
            ["ip", "-n", switch_ns, "link", "set", port, "master", "br0", "up"],
            ["ip", "-n", ns, "addr", "add", f"{ip}/{lan.prefixlen}", "dev", "eth0"],
            ["ip", "-n", ns, "link", "set", "eth0", "up"],
        ]
    steps += [
        ["ip", "link", "add", root_veth, "type", "veth", "peer", "name", "root", "netns", switch_ns],
        ["ip", "-n", switch_ns, "link", "set", "root", "master", "br0", "up"],
    ]
    for step in steps:
        run(step)
    Path(f"/proc/sys/net/ipv4/conf/{root_veth}/forwarding").write_text("0\n")
    Path(f"/proc/sys/net/ipv6/conf/{root_veth}/disable_ipv6").write_text("1\n")
    run(["ip", "addr", "add", f"{root_ip}/{lan.prefixlen}", "dev", root_veth])
    run(["ip", "link", "set", root_veth, "up"])


def remove(namespaces: Sequence[str], root_veth: str) -> None:
    """Delete the namespaces (their veths go with them) and the root veth, whichever exist."""
    for ns in namespaces:
        run(["ip", "netns", "del", ns], check=False)
    if link_exists(root_veth):
        run(["ip", "link", "del", root_veth], check=False)


def link_exists(name: str) -> bool:
    """Whether the root namespace has a network interface of that name."""
    return Path(f"/sys/class/net/{name}").exists()


def named_netns(prefix: str) -> list[str]:
    """The named network namespaces (``ip netns list``) whose name starts with ``prefix``."""
    try:
        names = os.listdir("/run/netns")
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith(prefix))
