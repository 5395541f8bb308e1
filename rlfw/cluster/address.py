"""The address every rlfw listener of this process binds and advertises: ``cluster.host``, resolved per node.

``cluster.host`` is a rule, not one address, because the processes of one run sit on different nodes and each must
bind an address it owns (an address of another node fails with ``EADDRNOTAVAIL``; a wildcard exposes the
listener on every interface, and peers still would not know which address to dial):

- ``auto`` (the default): loopback for a local Ray instance; the node's own Ray address (``--node-ip-address``)
  when the run joins a cluster (``cluster.address``);
- an IP address: exactly that one, which suits a single node (on another node it is an error naming both);
- an interface name (``eth0``) or a subnet (``10.0.0.0/24``): each node's own address on it.

Each process resolves the rule itself (the driver for the Lighthouse and the membership store, each trainer rank
for its stores and torchft Manager, each engine for its server) and advertises what it bound; peers dial what was
advertised. Wildcards (``0.0.0.0``, ``::``, ``""``) are refused.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import Dict, List, Optional

import psutil

LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "")


class AddressError(ValueError):
    """``cluster.host`` cannot be resolved on this node; the message names the rule and what the node has."""


def _addresses() -> Dict[str, List[str]]:
    """This node's IP addresses per interface, IPv4 first."""
    found: Dict[str, List[str]] = {}
    for name, addrs in psutil.net_if_addrs().items():
        ips = [a.address.split("%")[0] for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        found[name] = sorted(ips, key=lambda ip: ":" in ip)
    return found


def check_rule(rule: str) -> None:
    """Refuse what no node could resolve safely (the config check: a wildcard or a malformed value)."""
    if rule.strip() in WILDCARDS or rule.strip("[]") in WILDCARDS:
        raise AddressError(f"cluster.host={rule!r} is a wildcard: it would expose rlfw's listeners on every "
                           "interface; use auto, an IP address, an interface name (eth0) or a subnet (10.0.0.0/24)")
    if rule == "auto" or "/" in rule:
        if "/" in rule:
            try:
                ipaddress.ip_network(rule, strict=False)
            except ValueError:
                raise AddressError(f"cluster.host={rule!r} is not a subnet (e.g. 10.0.0.0/24)") from None
        return
    try:
        if ipaddress.ip_address(rule).is_unspecified:
            raise AddressError(f"cluster.host={rule!r} is a wildcard address")
        return
    except ValueError:
        pass
    if not rule.replace("-", "").replace("_", "").replace(".", "").replace(":", "").isalnum() or len(rule) > 15:
        raise AddressError(f"cluster.host={rule!r} is neither auto, an IP address, a subnet nor an interface name")


def resolve(rule: str, joined: bool, ray_node_ip: Optional[str] = None) -> str:
    """This process' address under ``rule``. ``joined``: the run joined a Ray cluster (``cluster.address``), whose
    address for this node is ``ray_node_ip`` (read from Ray when not given)."""
    check_rule(rule)
    here = _addresses()
    owned = {ip for ips in here.values() for ip in ips}
    if rule == "auto":
        if not joined:
            return LOOPBACK
        if ray_node_ip is None:
            import ray

            ray_node_ip = ray.util.get_node_ip_address()
        return ray_node_ip
    if "/" in rule:
        net = ipaddress.ip_network(rule, strict=False)
        for ips in here.values():
            for ip in ips:
                if ipaddress.ip_address(ip) in net:
                    return ip
        raise AddressError(f"cluster.host={rule}: no address of this node ({socket.gethostname()}) is in that "
                           f"subnet; its addresses: {_describe(here)}")
    try:
        ipaddress.ip_address(rule)
    except ValueError:
        if rule not in here or not here[rule]:
            raise AddressError(f"cluster.host={rule}: this node ({socket.gethostname()}) has no interface of that "
                               f"name with an address; its interfaces: {_describe(here)}") from None
        return here[rule][0]
    if rule not in owned:
        raise AddressError(
            f"cluster.host={rule} is not an address of this node ({socket.gethostname()}: {_describe(here)}); an "
            "explicit address suits one node: on several, name an interface (cluster.host=eth0), a subnet "
            "(cluster.host=10.0.0.0/24) or use cluster.host=auto")
    return rule


def host_port(address: str, port: int) -> str:
    """``address:port`` as URLs and bind strings spell it: an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def interface_of(address: str) -> Optional[str]:
    """The interface that holds ``address`` (Gloo's ``GLOO_SOCKET_IFNAME``), or None."""
    for name, ips in _addresses().items():
        if address in ips:
            return name
    return None


def pin_gloo_interface(address: str) -> None:
    """Make every Gloo group this process creates use ``address``'s interface. Gloo otherwise picks the interface
    of the machine's hostname, which on a node with several interfaces (or in a network namespace) is not the one
    that peers on other nodes can reach."""
    iface = interface_of(address)
    if iface:
        os.environ["GLOO_SOCKET_IFNAME"] = iface


def node_address(cluster) -> str:
    """``resolve`` for a process of a run configured with ``cluster`` (its ``host`` rule and ``address``)."""
    return resolve(cluster.host, joined=bool(cluster.address))


def _describe(here: Dict[str, List[str]]) -> str:
    return ", ".join(f"{name} {' '.join(ips)}" for name, ips in sorted(here.items()) if ips) or "none"
