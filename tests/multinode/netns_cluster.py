"""A real multi-node Ray cluster on one machine: a network namespace per node.

Each node is a namespace with one veth interface (``eth0``, like a machine's) on a private subnet; the other ends
sit on a bridge in a namespace of its own, so the machine's own interfaces and routes are never touched. Node 0
runs ``ray start --head``, the others ``ray start --address``; each with its own ``--node-ip-address``. The driver
runs inside node 0's namespace (``NetnsCluster.run``). A node's loss is every process of its namespace SIGKILLed
at once (its raylet too); a partition is its interface set down (processes alive, unreachable).

Everything the fixture makes is named after it (``rlfw<pid>…``) and removed by ``close`` even when a test fails:
processes by pid (``ip netns pids``), namespaces by name, Ray's files in a private temp dir. The only addresses
anything talks to are loopback and the fixture's own, on a subnet no interface of the machine uses.

Ray notices a dead node only after its health checks fail; they are set short here (``HEALTH_CHECK``).
``ray start --head`` turns Ray's token authentication on (Ray 2.60): the worker nodes and the driver run with
``RAY_AUTH_MODE=token``, as a user joining such a cluster would.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import psutil

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_PORT = 6379
# The gRPC server of every Ray worker process (rlfw's actors and the driver included) takes a port from this range
# and, on a cluster started with ``ray start``, listens on all interfaces: Ray's listener, not rlfw's.
RAY_WORKER_PORTS = (10002, 19999)
# GCS health checks of the raylets: a node silent for about 3 s is dead (Ray's defaults take about 30 s).
HEALTH_CHECK = {
    "RAY_health_check_initial_delay_ms": "1000",
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def netns_available() -> Optional[str]:
    """None when namespaces can be made here, else why not (the tests skip with it outside CI)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is missing"
    probe = f"rlfwprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that overlaps no address of this machine."""
    used = [ipaddress.ip_interface(f"{a.address}/{a.netmask}").network
            for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family.name == "AF_INET" and a.netmask]
    for third in range(200, 256):
        candidate = ipaddress.ip_network(f"10.{os.getpid() % 200 + 20}.{third}.0/24")
        if not any(candidate.overlaps(net) for net in used):
            return candidate
    raise RuntimeError("no free private /24 for the test cluster")


def _sh(*cmd: str, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(list(cmd), capture_output=True, text=True, **kwargs)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


class NetnsCluster:
    """``num_nodes`` Ray nodes with ``cpus[i]`` CPUs and Ray labels ``labels[i]`` each; ``start_node`` adds one
    later (regrowth)."""

    def __init__(self, num_nodes: int, cpus: Sequence[int], labels: Optional[Sequence[Dict[str, str]]] = None):
        self.tag = f"rlfw{os.getpid()}"
        self.subnet = _free_subnet()
        self.hosts = list(self.subnet.hosts())
        self.bridge_ns = f"{self.tag}br"
        self.namespaces: List[str] = []
        self.addresses: List[str] = []
        self.tmp = Path(tempfile.mkdtemp(prefix="rlfw-netns-"))
        self.ray_tmp = self.tmp / "ray"  # Ray's session files and ray_current_cluster: never /tmp/ray
        self.ray_tmp.mkdir()
        self.home = self.tmp / "home"  # ~/.ray/auth_token of this cluster, not the user's
        self.home.mkdir()
        try:
            _sh("ip", "netns", "add", self.bridge_ns)
            _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(num_nodes):  # one at a time: concurrent `ray start`s time out on a small machine
                self.start_node(cpus[i], (labels or [{}] * num_nodes)[i])
        except BaseException:
            self.close()
            raise

    @property
    def head_address(self) -> str:
        return f"{self.addresses[0]}:{HEAD_PORT}"

    def env(self, **extra: str) -> Dict[str, str]:
        """The environment of every process in the cluster, the driver's included."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(HEALTH_CHECK, HOME=str(self.home), RAY_TMPDIR=str(self.ray_tmp), RAY_AUTH_MODE="token",
                   RAY_USAGE_STATS_ENABLED="0", **extra)
        return env

    def _add_namespace(self) -> tuple:
        i = len(self.namespaces)
        ns, address = f"{self.tag}n{i}", str(self.hosts[i])
        _sh("ip", "netns", "add", ns)
        self.namespaces.append(ns)
        self.addresses.append(address)
        _sh("ip", "link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns",
            self.bridge_ns)
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "master", "br0")
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"p{i}", "up")
        _sh("ip", "-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        return i, ns, address

    def start_node(self, cpus: int, labels: Optional[Dict[str, str]] = None) -> int:
        """A new namespace and a Ray node in it (the head if it is the first); returns its index."""
        i, ns, address = self._add_namespace()
        cmd = [RAY, "start", f"--node-ip-address={address}", f"--num-cpus={cpus}", "--disable-usage-stats",
               f"--min-worker-port={RAY_WORKER_PORTS[0]}", f"--max-worker-port={RAY_WORKER_PORTS[1]}"]
        if labels:
            cmd.append("--labels=" + ",".join(f"{k}={v}" for k, v in labels.items()))
        if i == 0:
            # The cluster's token (``ray start --head`` would make one only without RAY_AUTH_MODE=token set).
            self.netns_exec(i, RAY, "get-auth-token", "--generate")
            cmd += ["--head", f"--port={HEAD_PORT}", "--include-dashboard=false", f"--temp-dir={self.ray_tmp}"]
        else:
            cmd.append(f"--address={self.head_address}")
        self.netns_exec(i, *cmd, timeout=120)
        return i

    def netns_exec(self, node: int, *cmd: str, check: bool = True, timeout: float = 60,
                   **env: str) -> subprocess.CompletedProcess:
        return _sh("ip", "netns", "exec", self.namespaces[node], *cmd, check=check, timeout=timeout,
                   env=self.env(**env))

    def popen(self, node: int, *cmd: str, log: Path, cwd: Optional[Path] = None, **env: str) -> subprocess.Popen:
        """A process in node ``node``'s namespace (the driver: node 0), output to ``log``."""
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[node], *cmd], env=self.env(**env),
                                stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=cwd)

    def pids(self, node: int) -> List[int]:
        out = _sh("ip", "netns", "pids", self.namespaces[node], check=False).stdout
        return [int(p) for p in out.split()]

    def kill_node(self, node: int) -> List[int]:
        """Every process of the node at once, its raylet included: a machine lost."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return pids

    def partition(self, node: int, cut: bool = True) -> None:
        """Cut the node off the network (``cut=False`` reconnects it); its processes run on."""
        _sh("ip", "-n", self.namespaces[node], "link", "set", "eth0", "down" if cut else "up")

    def listeners(self, node: int) -> List[str]:
        """Local addresses of the node's listening TCP sockets (``ss -ltn`` in its namespace)."""
        out = _sh("ip", "netns", "exec", self.namespaces[node], "ss", "-Hltn").stdout
        return [line.split()[3].rsplit(":", 1)[0].strip("[]") for line in out.splitlines() if line.strip()]

    def ray_nodes(self) -> str:
        return self.netns_exec(0, RAY, "status", f"--address={self.head_address}", check=False).stdout

    def close(self) -> None:
        for i in reversed(range(len(self.namespaces))):
            self.kill_node(i)
        deadline = time.monotonic() + 10
        while any(self.pids(i) for i in range(len(self.namespaces))) and time.monotonic() < deadline:
            time.sleep(0.1)
        for ns in [*self.namespaces, self.bridge_ns]:
            _sh("ip", "netns", "del", ns, check=False)
        self.namespaces, self.addresses = [], []
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self) -> "NetnsCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
