"""cluster.host is a rule each node resolves to an address it owns; wildcards never pass."""

import socket

import psutil
import pytest

from rlfw.cluster.address import AddressError, check_rule, interface_of, pin_gloo_interface, resolve
from rlfw.cluster.store import serve_store


def loopback_interface() -> str:
    return next(name for name, addrs in psutil.net_if_addrs().items()
                if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs))


def test_auto_is_loopback_locally_and_the_ray_address_on_a_cluster():
    assert resolve("auto", joined=False) == "127.0.0.1"
    assert resolve("auto", joined=True, ray_node_ip="10.1.2.3") == "10.1.2.3"


def test_an_interface_and_a_subnet_resolve_to_this_nodes_address_on_them():
    assert resolve(loopback_interface(), joined=True) == "127.0.0.1"
    assert resolve("127.0.0.0/8", joined=True) == "127.0.0.1"
    assert interface_of("127.0.0.1") == loopback_interface()


@pytest.mark.parametrize("rule", ["0.0.0.0", "::", "", "[::]"])
def test_wildcards_are_refused(rule):
    with pytest.raises(AddressError, match="wildcard"):
        check_rule(rule)


def test_an_address_of_another_node_names_the_rule_and_what_this_node_has():
    with pytest.raises(AddressError, match=r"cluster.host=192.0.2.250 is not an address of this node .*127.0.0.1"):
        resolve("192.0.2.250", joined=True)  # TEST-NET-1: never assigned here
    with pytest.raises(AddressError, match="no interface of that name"):
        resolve("nosuchif0", joined=True)
    with pytest.raises(AddressError, match="no address of this node"):
        resolve("198.51.100.0/24", joined=True)


def test_gloo_is_pinned_to_the_interface_of_the_address(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    pin_gloo_interface("127.0.0.1")
    import os

    assert os.environ["GLOO_SOCKET_IFNAME"] == loopback_interface()


def test_a_store_listens_on_its_address_only():
    store = serve_store(resolve("auto", joined=False))
    local = {c.laddr for c in psutil.Process().net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", store.port) in {(a.ip, a.port) for a in local}
    assert not any(a.port == store.port and a.ip in ("0.0.0.0", "::") for a in local)


def test_host_port_brackets_ipv6():
    from rlfw.cluster.address import host_port

    assert host_port("127.0.0.1", 80) == "127.0.0.1:80"
    assert host_port("10.0.0.7", 30000) == "10.0.0.7:30000"
    assert host_port("::1", 8080) == "[::1]:8080"
    assert host_port("fd00::2", 1) == "[fd00::2]:1"
