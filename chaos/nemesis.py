"""The network the chaos run controls: a namespace for the workers, two veth links to the host.

The workers run in a network namespace of their own. Two veth pairs join it
to the host:

- the **lock link**, to the lock service: on the host's end, a TCP proxy per
  server endpoint (``tests/netproxy.py``) forwards to the server on loopback;
  the nemesis cuts, black-holes, drops and slows this link;
- the **register link**, to PostgreSQL's fenced register: never touched, so
  that the checker sees every write the workers made.

Faults on the lock link:

- ``partition``: the host's end of the link is set down (nothing passes);
- ``blackhole``: inside the namespace, iptables drops every TCP segment from
  the host that carries data, SYN-ACKs excepted: connections open, requests
  reach the server and run, and no reply ever arrives;
- ``loss``: iptables' ``statistic`` match drops a share of packets both ways;
- ``latency``: the proxies delay every chunk (this kernel has no ``netem``).

Traffic goes only to the namespace made here and to loopback. Needs root and
iptables; ``available()`` says why not otherwise.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

from tests.netproxy import Proxy


def available() -> str | None:
    """None if network faults can run here, else why not."""
    if os.geteuid() != 0:
        return "network faults need root (network namespaces and iptables)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"network faults need {tool} (apt: {'iproute2' if tool == 'ip' else tool})"
    return None


def _run(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


class Net:
    """The workers' namespace and its two links; ``close()`` removes them."""

    def __init__(self) -> None:
        tag = os.getpid() % 100000
        k = os.getpid() % 250 + 1
        self.ns = f"dlchaos{tag}"
        self.lock_host, self.lock_ns = f"10.199.{k}.1", f"10.199.{k}.2"
        self.reg_host, self.reg_ns = f"10.199.{k}.5", f"10.199.{k}.6"
        self.lock_if = f"dlcL{tag}"
        self.reg_if = f"dlcR{tag}"
        self.proxies: list[Proxy] = []
        self._rules: list[list[str]] = []
        _run("ip", "netns", "add", self.ns)
        try:
            for name, host, peer in (
                (self.lock_if, self.lock_host, self.lock_ns),
                (self.reg_if, self.reg_host, self.reg_ns),
            ):
                _run("ip", "link", "add", name + "h", "type", "veth", "peer", "name", name + "n")
                _run("ip", "link", "set", name + "n", "netns", self.ns)
                _run("ip", "addr", "add", f"{host}/30", "dev", name + "h")
                _run("ip", "link", "set", name + "h", "up")
                self.exec("ip", "addr", "add", f"{peer}/30", "dev", name + "n")
                self.exec("ip", "link", "set", name + "n", "up")
            self.exec("ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def exec(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns, *args)

    def prefix(self) -> list[str]:
        """Run a command in the namespace: prepend this."""
        return ["ip", "netns", "exec", self.ns]

    def lock_proxy(self, port: int) -> Proxy:
        """A proxy on the lock link's host end to ``127.0.0.1:port``."""
        proxy = Proxy(port, listen=self.lock_host)
        self.proxies.append(proxy)
        return proxy

    def register_proxy(self, port: int) -> Proxy:
        proxy = Proxy(port, listen=self.reg_host)
        self.proxies.append(proxy)
        return proxy

    # --- faults on the lock link ---------------------------------------------------

    def partition(self, on: bool) -> None:
        _run("ip", "link", "set", self.lock_if + "h", "down" if on else "up")

    def _iptables(self, on: bool, rules: list[list[str]]) -> None:
        for rule in rules:
            self.exec("iptables", "-A" if on else "-D", *rule)

    def _blackhole_rules(self) -> list[list[str]]:
        # Segments without SYN and longer than a bare ACK (52 bytes with
        # timestamps) carry data: the server's replies.
        return [
            ["INPUT", "-i", self.lock_if + "n", "-p", "tcp", "--tcp-flags", "SYN", "NONE",
             "-m", "length", "--length", "53:65535", "-j", "DROP"],
        ]  # fmt: skip

    def blackhole(self, on: bool) -> None:
        self._iptables(on, self._blackhole_rules())

    def _loss_rules(self, share: float) -> list[list[str]]:
        match = ["-m", "statistic", "--mode", "random", "--probability", f"{share:g}"]
        return [
            ["INPUT", "-i", self.lock_if + "n", *match, "-j", "DROP"],
            ["OUTPUT", "-o", self.lock_if + "n", *match, "-j", "DROP"],
        ]

    def loss(self, on: bool, share: float = 0.2) -> None:
        self._iptables(on, self._loss_rules(share))

    def latency(self, seconds: float) -> None:
        for proxy in self.proxies:
            if proxy in self.lock_proxies():
                proxy.latency = seconds

    def lock_proxies(self) -> list[Proxy]:
        return [p for p in self.proxies if p._listener.getsockname()[0] == self.lock_host]

    def heal(self) -> None:
        """Undo every fault (the link up, no rules, no latency)."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self.partition(False)
        with contextlib.suppress(subprocess.CalledProcessError):
            self.exec("iptables", "-F", "INPUT")
            self.exec("iptables", "-F", "OUTPUT")
        self.latency(0.0)

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.close()
        self.proxies = []
        for name in (self.lock_if, self.reg_if):
            subprocess.run(["ip", "link", "del", name + "h"], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", self.ns], capture_output=True, timeout=30)
