"""Two hosts on one machine: two network namespaces joined by a veth pair, an address each.

Traffic between them crosses a real interface, so one side's link can be taken down (a partition; `tc netem`
is not in this kernel). The addresses exist only inside the namespaces made here. A program runs on a host in
a mount namespace of its own whose /etc/hosts names both hosts. (`ip netns exec` would do that too, from
/etc/netns, but it also mounts a fresh /sys, without the cgroup folders slurmd needs.) Needs root.
"""

import os
import shutil
import subprocess

# A /30 of the private range, present only inside the two namespaces below: nothing else can be reached.
SUBNET = "10.231.0"
PREFIX = 30
# Runs "$@" on a host: its own /etc/hosts ($1, mounted in this mount namespace only) and network ($2).
ON_HOST = 'mount --bind "$1" /etc/hosts && net="$2" && shift 2 && exec nsenter --net="$net" -- "$@"'


def unavailable():
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [p for p in ("ip", "unshare", "nsenter", "mount") if shutil.which(p) is None]
    if missing:
        return f"{', '.join(missing)} not installed (iproute2, util-linux, mount)"
    return None


# Runs "$@" in a network namespace of its own with only its loopback up: what crosses that loopback is its own,
# whatever the suite's other workers send over the machine's.
OWN_LOOPBACK = ["unshare", "--net", "--", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


class Hosts:
    """Host i is namespace `names[i]` at address SUBNET.(i+1), whose link is `links[i]`; `hostnames` resolve
    on both hosts, through a hosts file in `folder`. Close it (a context manager) to remove the namespaces."""

    def __init__(self, tag, folder, hostnames=()):
        self.names = [f"{tag}-{side}" for side in "ab"]
        self.links = [f"{tag[:11]}-v{side}" for side in "ab"]  # interface names: 15 characters at most
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(2)]
        self.hostnames = list(hostnames)
        self.hosts_file = os.path.join(folder, "hosts")
        self._made = []
        try:
            self._make()
        except BaseException:
            self.close()
            raise

    def _make(self):
        for name in self.names:
            _ip("netns", "add", name)
            self._made.append(name)
        _ip("link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
        for name, link, address in zip(self.names, self.links, self.addresses):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/{PREFIX}", "dev", link)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", link, "up")
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames)))

    def run_in(self, i):
        """The command prefix that runs a program on host i; the program keeps the PID of the command."""
        return ["unshare", "--mount", "--", "sh", "-c", ON_HOST, "sh", self.hosts_file, f"/run/netns/{self.names[i]}"]

    def link(self, i, state):
        """Takes host i's side of the link "down" or brings it back "up"."""
        _ip("-n", self.names[i], "link", "set", self.links[i], state)

    def close(self):
        """Deleting a namespace deletes its end of the veth pair, and with it the other end. Processes started
        inside must be ended first."""
        for name in self._made:
            subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)
        self._made = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
