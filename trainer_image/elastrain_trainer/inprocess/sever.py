"""Ending a generation's gloo collectives when a peer goes dark (docs/recovery.md section 8).

A peer that vanishes without closing its sockets (packets dropped, a frozen host) leaves every
survivor's gloo operation waiting for its timeout: gloo has no abort (`ProcessGroupGloo.abort`
is an empty default) and an operation's timeout is fixed when it starts. What does end it at
once is what a killed peer's kernel does: the pair's socket reads EOF, gloo fails the operation
("Connection closed by peer") and the existing recovery path runs. So once the heartbeat judged
the generation failed, each survivor shuts down (`shutdown(2)`, not `close`: gloo still owns
the descriptor) its own sockets of that generation's groups. The operation then fails, it does
not run on in the background: nothing it would have received is ever written into the tensors
the next generation trains (a peer thawed later finds its sockets reset and fails the same
way). Each survivor severs its own pairs: a pending receive from the dark peer is not failed by
another pair's EOF (seen: a survivor whose peer severed only that survivor's pair waited out
its timeout).

Which sockets: those created while the generation's groups formed (inodes seen in
/proc/self/fd before and after), without the listeners (gloo's listener thread aborts the
process when its socket is shut down), and among them only gloo's pairs: accepted on one of
this node's listeners, or connected to a listener a peer published under the generation. An
S3 upload or a store reconnect that opened a socket meanwhile is neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping

LISTEN = "0A"
# A pair that can still be cut: established, or the peer's end closed and ours not yet.
# Not one this node already shut down (FIN_WAIT and after).
CUTTABLE = frozenset({"01", "08"})
_WILDCARDS = {"0.0.0.0", "::"}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    ip: str
    port: int

    def text(self) -> str:
        return f"{self.ip}:{self.port}"


@dataclasses.dataclass(frozen=True)
class TcpSocket:
    local: Endpoint
    remote: Endpoint
    state: str  # /proc/net/tcp's hex state: 01 established, 0A listening


def parse_address(text: str) -> Endpoint:
    """/proc/net/tcp{,6}'s `HEXIP:HEXPORT`: the IP in the kernel's byte order, 32-bit words
    (one for IPv4, four for IPv6). An IPv4-mapped IPv6 address reads as its IPv4 one."""
    hexip, hexport = text.split(":")
    raw = b"".join(bytes.fromhex(hexip[i:i + 8])[::-1] for i in range(0, len(hexip), 8))
    ip = ipaddress.ip_address(raw)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return Endpoint(str(ip), int(hexport, 16))


def parse_table(text: str) -> dict[int, TcpSocket]:
    """inode -> socket, from the text of /proc/net/tcp or tcp6."""
    out = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        out[int(fields[9])] = TcpSocket(parse_address(fields[1]), parse_address(fields[2]),
                                        fields[3])
    return out


def tcp_table() -> dict[int, TcpSocket]:
    """This network namespace's TCP sockets, by inode."""
    table: dict[int, TcpSocket] = {}
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(path) as f:
            table.update(parse_table(f.read()))
    return table


def socket_fds() -> dict[int, int]:
    """This process's socket descriptors: inode -> fd."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/self/fd/{name}")
                if target.startswith("socket:["):
                    out[int(target[8:-1])] = int(name)
    return out


def _serves(endpoint: Endpoint, listener: Endpoint) -> bool:
    return endpoint.port == listener.port and (listener.ip in _WILDCARDS
                                               or endpoint.ip == listener.ip)


def pair_sockets(created: Iterable[int], table: Mapping[int, TcpSocket],
                 own: Iterable[Endpoint], peers: Iterable[Endpoint]) -> frozenset[int]:
    """The gloo pairs among `created`: accepted on one of `own` listeners, or connected to
    one of `peers`' listeners, and not shut down yet. Never a listener."""
    own, peers = tuple(own), tuple(peers)
    found = set()
    for inode in created:
        s = table.get(inode)
        if s is None or s.state not in CUTTABLE:
            continue
        if any(_serves(s.local, li) for li in own) or any(_serves(s.remote, li) for li in peers):
            found.add(inode)
    return frozenset(found)


@dataclasses.dataclass(frozen=True)
class GroupSockets:
    """The sockets a generation's groups made on this node, and its listeners among them."""

    created: frozenset[int]
    listeners: tuple[Endpoint, ...]

    @classmethod
    def since(cls, before: Iterable[int]) -> GroupSockets:
        """What was created since `before` (socket_fds() taken before the groups formed)."""
        created = frozenset(socket_fds()) - frozenset(before)
        table = tcp_table()
        listeners = tuple(sorted((table[i].local for i in created
                                  if i in table and table[i].state == LISTEN),
                                 key=lambda e: (e.ip, e.port)))
        return cls(created, listeners)

    def merged(self, more: GroupSockets) -> GroupSockets:
        listeners = tuple(sorted(set(self.listeners) | set(more.listeners),
                                 key=lambda e: (e.ip, e.port)))
        return GroupSockets(self.created | more.created, listeners)

    def published(self) -> str:
        """What this node publishes for its peers: its listeners."""
        return json.dumps([e.text() for e in self.listeners])

    def sever(self, peers: Iterable[Endpoint]) -> int:
        """Shut down this node's pairs of these groups; how many. A descriptor closed or
        reused meanwhile (the group already destroyed) is left alone."""
        fds = socket_fds()
        chosen = pair_sockets(self.created & set(fds), tcp_table(), self.listeners, peers)
        return sum(_shutdown(fds[inode], inode) for inode in chosen)


@dataclasses.dataclass(frozen=True)
class HeldGroups:
    """A member's groups in use: their sockets, the generations they serve (a kept plan reuses
    them) and the nodes they connect."""

    gens: frozenset[int]
    sockets: GroupSockets
    nodes: tuple[str, ...]

    def serving(self, gen: int) -> HeldGroups:
        return dataclasses.replace(self, gens=self.gens | {gen})

    def adopting(self, more: GroupSockets) -> HeldGroups:
        """With the sockets of a group the script made in these generations (user_groups)."""
        return dataclasses.replace(self, sockets=self.sockets.merged(more))

    def sever(self, gen: int, node_id: str,
              listeners: Callable[[int, list[str]], Mapping[str, str]]) -> int | None:
        """Shut down these groups' pairs if they serve `gen` (how many; None: they do not).
        `listeners(g, nodes)`: what each node published under generation g. A peer publishes
        under each generation the groups serve as it enters it; one that went dark first
        published under an earlier one: the newest each peer has counts."""
        if gen not in self.gens:
            return None
        published: dict[str, str] = {}
        for g in sorted(self.gens, reverse=True):
            rest = [n for n in self.nodes if n != node_id and n not in published]
            if not rest:
                break
            published |= listeners(g, rest)
        return self.sockets.sever([e for text in published.values()
                                   for e in parse_published(text)])


class Held:
    """A member's HeldGroups as its generations come and go, and what it publishes of them:
    the listeners each generation's peers read to cut their pairs with this node."""

    def __init__(self, node_id: str, publish: Callable[[int, str, str], None]) -> None:
        self.node_id, self.publish = node_id, publish  # publish(gen, node_id, listeners)
        self.groups: HeldGroups | None = None
        # What the peers published, as last read while the store answered (`learn`): a
        # store that went dark with a peer (the store's node hosts a worker too) is replaced
        # by an empty one, where the sever would find no peer's listener and leave the pairs
        # this node connected waiting on the dark peer.
        self._known: dict[int, dict[str, str]] = {}

    def formed(self, gen: int, nodes: tuple[str, ...], before: Iterable[int]) -> None:
        """`gen`'s groups formed (`before`: socket_fds() before they did)."""
        sockets = GroupSockets.since(before)
        self.publish(gen, self.node_id, sockets.published())
        self.groups = HeldGroups(frozenset([gen]), sockets, nodes)

    def kept(self, gen: int) -> None:
        """A kept plan: the groups serve `gen` too."""
        if self.groups is not None:
            self.groups = self.groups.serving(gen)
            self.publish(gen, self.node_id, self.groups.sockets.published())

    def adopt(self, gen: int, before: Iterable[int]) -> None:
        """A group the script made in `gen` (user_groups): severed with the generation's."""
        if self.groups is not None:
            self.groups = held = self.groups.adopting(GroupSockets.since(before))
            self.publish(gen, self.node_id, held.sockets.published())

    def learn(self, gen: int,
              listeners: Callable[[int, list[str]], Mapping[str, str]]) -> bool:
        """The heartbeat thread's, while the store answers: read what the peers of `gen`
        published (again later: a peer publishes more when its script makes a group), for a
        sever after the store is gone. Whether every peer's was there: not yet while these
        groups do not serve `gen` (the heartbeat watches a generation before its groups form),
        and no request is made then."""
        held = self.groups
        if held is None or gen not in held.gens:
            return False
        peers = [n for n in held.nodes if n != self.node_id]
        found = dict(listeners(gen, peers)) if peers else {}
        self._known = {g: k for g, k in self._known.items() if g in held.gens} | {
            gen: self._known.get(gen, {}) | found}
        return len(found) == len(peers)

    def sever(self, gen: int,
              listeners: Callable[[int, list[str]], Mapping[str, str]]) -> int | None:
        held = self.groups  # the heartbeat thread's read: replaced whole, never changed
        if held is None:
            return None
        known = self._known

        def published(g: int, nodes: list[str]) -> Mapping[str, str]:
            read = dict(listeners(g, nodes))
            return {n: t for n, t in known.get(g, {}).items() if n in nodes} | read

        return held.sever(gen, self.node_id, published)


def parse_published(text: str) -> list[Endpoint]:
    out = []
    for item in json.loads(text):
        host, _, port = str(item).rpartition(":")
        out.append(Endpoint(host, int(port)))
    return out


def _shutdown(fd: int, inode: int) -> bool:
    try:
        dup = os.dup(fd)
    except OSError:
        return False
    try:
        same = os.fstat(dup).st_ino == inode
        s = socket.socket(fileno=dup) if same else None
    except OSError:
        s = None
    if s is None:
        os.close(dup)
        return False
    try:
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:  # not connected any more
        return False
    finally:
        s.close()  # the duplicate only: gloo's descriptor stays open until gloo closes it
