"""Whether a node still answers on the network: what tells a node that is powered off or cut off
from one that is only slow, in seconds rather than after its silence.

Each node's hang supervisor listens on a TCP port of the address its ranks use toward the master
(`Listener`; on the master itself, toward another node: see `listening_address`) and publishes it
in its summary. A live node's kernel answers a connection at once
(the listener accepts and closes it; a refused connection is an answer too), whatever its
processes are doing: busy, stopped, stuck in a collective. A node that is powered off, or whose
link is down, answers nothing: the connection times out, or its neighbours' ARP fails
(EHOSTUNREACH). `Prober` asks, from an aggregating supervisor, only the nodes that have not said
that their ranks are still while this node's ranks wait, so a healthy job probes nothing.

No process group and no collective is involved: a node can be asked while every collective hangs.
"""

from __future__ import annotations

import errno
import ipaddress
import select
import socket
import threading
import time
from typing import Callable, Optional

PROBE_TIMEOUT = 2.0  # one SYN retransmitted (after 1 s) within it: a lost packet is not a dead node
PROBE_EVERY = 2.0
BATCH = 256
# Connection errors that are an answer from the node's kernel: it is up and on the network.
ANSWERED = (0, errno.ECONNREFUSED, errno.ECONNRESET)


def local_address(toward: str) -> Optional[tuple[int, str]]:
    """(address family, this host's address) on the route toward `toward` (the master): the
    interface the ranks' sockets use. No packet is sent (a UDP socket's connect only routes)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(toward, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.connect(target)
            return family, udp.getsockname()[0]
    except OSError:
        return None


def listening_address(master: str, others: list[str]) -> Optional[tuple[int, str]]:
    """The address to listen on, one the other nodes reach: this host's on the route toward the
    master, or, where that is a loopback address, toward the first of `others` (the job's other
    nodes) that is not. On the master itself the route toward its own name is a loopback one
    wherever that name is the host's own (Debian's `127.0.1.1` line, as PBS and Torque name a
    master): a probe of 127.0.1.1 from another node asks that node itself, which always answers,
    and a master that powered off was never found unreachable. A loopback address is kept only
    where nothing else routes (every node on this host)."""
    first = None
    for target in (master, *others):
        found = local_address(target)
        if found is None:
            continue
        if not ipaddress.ip_address(found[1].split("%")[0]).is_loopback:
            return found
        first = first or found
    return first


class Listener:
    """A TCP port that answers every connection (accepted, then closed), on a daemon thread."""

    def __init__(self, family: int, address: str) -> None:
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((address, 0))
        self.socket.listen(1024)  # a stopped node's kernel still answers until its queue is full
        self.address = (address, self.socket.getsockname()[1])
        threading.Thread(target=self._answer, name="jobgen-reachability", daemon=True).start()

    @classmethod
    def toward(cls, master: str, others: list[str] = ()) -> Optional["Listener"]:
        found = listening_address(master, list(others))
        if found is None:
            return None
        try:
            return cls(*found)
        except OSError:
            return None

    def _answer(self) -> None:
        while True:
            try:
                connection, _ = self.socket.accept()
            except OSError:
                return  # closed
            connection.close()

    def close(self) -> None:
        # shutdown first: it wakes the thread blocked in accept, which would hold the port open.
        for step in (lambda: self.socket.shutdown(socket.SHUT_RDWR), self.socket.close):
            try:
                step()
            except OSError:
                pass


def unanswered(targets: dict[int, tuple[str, int]], timeout: Optional[float] = None) -> set[int]:
    """Of `targets` (key: (address, port)), those whose kernel did not answer a TCP connection
    within `timeout`: asked BATCH at a time (non-blocking connects), so a thousand cost a few
    timeouts at most, and stay within the usual limit of 1,024 open files."""
    keys = list(targets)
    silent: set[int] = set()
    for start in range(0, len(keys), BATCH):
        silent |= _unanswered({key: targets[key] for key in keys[start:start + BATCH]},
                              PROBE_TIMEOUT if timeout is None else timeout)
    return silent


def _unanswered(targets: dict[int, tuple[str, int]], timeout: float) -> set[int]:
    pending: dict[int, tuple[int, socket.socket]] = {}
    silent: set[int] = set()
    poller = select.poll()
    try:
        for key, (address, port) in targets.items():
            try:
                family, kind, proto, _, target = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
                sock = socket.socket(family, kind, proto)
            except OSError:
                silent.add(key)
                continue
            sock.setblocking(False)
            code = sock.connect_ex(target)
            if code in ANSWERED:
                sock.close()
                continue
            if code not in (errno.EINPROGRESS, errno.EWOULDBLOCK):
                silent.add(key)  # no route: EHOSTUNREACH, ENETUNREACH
                sock.close()
                continue
            pending[sock.fileno()] = (key, sock)
            poller.register(sock, select.POLLOUT | select.POLLERR | select.POLLHUP)
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for fd, _ in poller.poll(left * 1000):
                key, sock = pending.pop(fd)
                poller.unregister(fd)
                if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) not in ANSWERED:
                    silent.add(key)
                sock.close()
        silent.update(key for key, _ in pending.values())
    finally:
        for _, sock in pending.values():
            sock.close()
    return silent


class Prober:
    """Probes the nodes it is asked about, every PROBE_EVERY seconds, on its own thread (a probe
    may take PROBE_TIMEOUT, which the supervisor's one-second loop cannot wait for); each node it
    learns of, once at first (`learn`). `unreachable(k)`: (since when by `clock`, how many probes
    in a row) node k has failed every probe; None when it answered the last one, was not asked,
    or never answered any: a site whose firewall drops connections to a node's other ports
    (allowing only its collectives' own) makes every probe fail, and such a node is judged by its
    silence alone, as before any probe."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._asked: dict[int, tuple[str, int]] = {}
        self._failed: dict[int, tuple[float, int]] = {}
        self._learned: dict[int, tuple[str, int]] = {}  # probed once, or to be
        self._answered: set[int] = set()  # nodes that answered a probe at least once
        self._first: dict[int, tuple[str, int]] = {}  # nodes to probe once, at the next round
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def ask(self, targets: dict[int, tuple[str, int]]) -> None:
        """Probe these nodes from now on (and no others); an empty dict stops probing."""
        with self._lock:
            if targets == self._asked:
                return
            self._asked = dict(targets)
            for key in list(self._failed):
                if key not in targets:
                    del self._failed[key]
        if targets:
            self._start()
        self._wake.set()

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="jobgen-prober", daemon=True)
            self._thread.start()

    def learn(self, targets: dict[int, tuple[str, int]]) -> None:
        """Probe once each of these nodes not probed at this address before."""
        with self._lock:
            new = {key: address for key, address in targets.items() if self._learned.get(key) != address}
            if not new:
                return
            self._learned.update(new)
            self._first.update(new)
        self._start()
        self._wake.set()

    def unreachable(self, key: int) -> Optional[tuple[float, int]]:
        with self._lock:
            return self._failed.get(key) if key in self._answered else None

    def close(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            with self._lock:
                first, self._first = self._first, {}
                targets = {**first, **self._asked}
            if not targets:
                self._wake.wait()
                continue
            started, took = self.clock(), time.monotonic()
            silent = unanswered(targets)
            with self._lock:
                self._answered.update(key for key in targets if key not in silent)
                for key in targets:
                    if key not in self._asked:
                        continue
                    if key in silent:
                        since, count = self._failed.get(key, (started, 0))
                        self._failed[key] = (since, count + 1)
                    else:
                        self._failed.pop(key, None)
            self._stop.wait(max(0.0, PROBE_EVERY - (time.monotonic() - took)))


def probe_address(summary: dict) -> Optional[tuple[str, int]]:
    """The (address, port) a node's summary publishes for probes, if any."""
    found = summary.get("probe")
    if isinstance(found, list) and len(found) == 2 and isinstance(found[0], str) and isinstance(found[1], int):
        return found[0], found[1]
    return None

