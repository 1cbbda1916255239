"""Separate hosts (tests/cluster/hosts.py) are what a real cluster's nodes are to each other."""

from __future__ import annotations

import subprocess

from tests.cluster.hosts import DECOY_INTERFACE, REAL_INTERFACE


def on(host, *argv: str) -> str:
    done = host.run(list(argv), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_each_host_has_its_own_name_and_its_name_is_127_0_1_1_there(separate_hosts) -> None:
    host1, host2 = separate_hosts.hosts
    assert (on(host1, "hostname"), on(host2, "hostname")) == ("host1", "host2")
    assert on(host1, "getent", "hosts", "host1").split()[0] == "127.0.1.1"
    assert on(host2, "getent", "hosts", "host1").split()[0] == host1.address
    # The machine's own /etc/hosts is not touched.
    assert "host1" not in open("/etc/hosts").read()


def test_hosts_reach_each_other_by_name_over_ssh_only_on_the_real_interface(separate_hosts) -> None:
    host1, host2 = separate_hosts.hosts
    assert on(host1, "ssh", *separate_hosts.ssh_options, "host2", "hostname") == "host2"
    interfaces = on(host1, "ip", "-o", "link", "show").splitlines()
    names = [line.split(":")[1].strip().split("@")[0] for line in interfaces]
    assert sorted(names[1:3]) == [DECOY_INTERFACE, f"{DECOY_INTERFACE}p"] and names[3] == REAL_INTERFACE, names
    assert f"dev {REAL_INTERFACE}" in on(host1, "ip", "-4", "route", "get", host2.address)
    # The private network is not this machine's.
    assert subprocess.run(["ip", "-4", "-o", "addr", "show", "to", f"{host1.address}/32"], capture_output=True, text=True).stdout == ""
