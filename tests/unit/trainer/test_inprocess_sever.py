"""inprocess.sever: which sockets are a generation's gloo pairs, and shutting them down (real
sockets on loopback; gloo's own, in tests/integration/trainer/test_inprocess_dark_peers.py)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator

import pytest

from elastrain_trainer.inprocess import sever
from elastrain_trainer.inprocess.sever import Endpoint, GroupSockets, TcpSocket


def test_proc_net_addresses_parse_in_the_kernels_byte_order() -> None:
    assert sever.parse_address("0100007F:1F90") == Endpoint("127.0.0.1", 8080)
    assert sever.parse_address("00000000:0050") == Endpoint("0.0.0.0", 80)
    assert sever.parse_address("00000000000000000000000001000000:0016") == Endpoint("::1", 22)
    # An IPv4-mapped IPv6 address (a dual-stack socket) reads as the IPv4 one.
    assert sever.parse_address("0000000000000000FFFF00000F00020A:01BB") == Endpoint(
        "10.2.0.15", 443)


def test_a_table_line_gives_local_remote_and_state_by_inode() -> None:
    text = ("  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  "
            "timeout inode\n"
            "   0: 0100007F:9C40 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0 "
            "       0 4242 1 0000000000000000 100 0 0 10 0\n"
            "   1: 0100007F:D431 0100007F:9C41 01 00000000:00000000 00:00000000 00000000     0 "
            "       0 4343 1 0000000000000000 20 4 30 10 -1\n")
    assert sever.parse_table(text) == {
        4242: TcpSocket(Endpoint("127.0.0.1", 40000), Endpoint("0.0.0.0", 0), "0A"),
        4343: TcpSocket(Endpoint("127.0.0.1", 54321), Endpoint("127.0.0.1", 40001), "01")}


def test_pairs_are_accepted_on_our_listener_or_connected_to_a_peers_never_a_listener() -> None:
    own, peer = Endpoint("10.0.0.1", 40000), Endpoint("10.0.0.2", 41000)
    table = {
        1: TcpSocket(own, Endpoint("0.0.0.0", 0), sever.LISTEN),
        2: TcpSocket(own, Endpoint("10.0.0.2", 55000), "01"),                # accepted
        3: TcpSocket(Endpoint("10.0.0.1", 56000), peer, "01"),               # connected out
        4: TcpSocket(Endpoint("10.0.0.1", 57000), Endpoint("10.0.0.9", 9000), "01"),  # S3
        5: TcpSocket(Endpoint("10.0.0.1", 58000), Endpoint("10.0.0.3", 41000), "01"),  # same port
        6: TcpSocket(own, Endpoint("10.0.0.3", 55001), "01"),                # not created then
    }
    assert sever.pair_sockets({1, 2, 3, 4, 5}, table, [own], [peer]) == {2, 3}
    # A listener bound to every address serves by port alone.
    anywhere = Endpoint("0.0.0.0", 41000)
    assert sever.pair_sockets({3, 4, 5}, table, [], [anywhere]) == {3, 5}


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    made: list[socket.socket] = []
    yield made
    for s in made:
        s.close()


def test_severing_shuts_down_only_the_pairs_and_the_other_end_reads_eof(
        sockets: list[socket.socket]) -> None:
    """A listener, a pair accepted on it and one connected to a "peer's" listener, made after
    a snapshot, as a generation's groups are; an unrelated connection made meanwhile (an
    upload) and one made before stay untouched, and so does the listener."""
    elsewhere = socket.create_server(("127.0.0.1", 0))
    peer = socket.create_server(("127.0.0.1", 0))
    before_conn = socket.create_connection(elsewhere.getsockname())
    sockets += [elsewhere, peer, before_conn]
    before = sever.socket_fds()

    listener = socket.create_server(("127.0.0.1", 0))
    far_in = socket.create_connection(listener.getsockname())   # a peer connecting to us
    accepted, _ = listener.accept()
    out = socket.create_connection(peer.getsockname())          # we connect to the peer
    far_out, _ = peer.accept()
    upload = socket.create_connection(elsewhere.getsockname())  # not gloo's
    far_upload, _ = elsewhere.accept()
    far_before, _ = elsewhere.accept()
    sockets += [listener, far_in, accepted, out, far_out, upload, far_upload, far_before]

    group = GroupSockets.since(before)
    assert group.listeners == (Endpoint(*listener.getsockname()),)
    assert sever.parse_published(group.published()) == [Endpoint(*listener.getsockname())]
    assert group.sever([Endpoint(*peer.getsockname())]) == 2

    for far in (far_in, far_out):
        far.settimeout(5)
        assert far.recv(1) == b""  # EOF: what gloo reads from a killed peer's socket
    for far in (far_upload, far_before):
        far.setblocking(False)
        with pytest.raises(BlockingIOError):
            far.recv(1)  # still open, nothing sent
    # The listener still accepts (gloo's listener thread aborts the process when it fails).
    late = socket.create_connection(listener.getsockname())
    sockets.append(late)
    listener.settimeout(5)
    sockets.append(listener.accept()[0])
    # Severing again finds nothing left to cut; the descriptors stay open, gloo closes them.
    assert group.sever([Endpoint(*peer.getsockname())]) == 0
    assert accepted.fileno() >= 0 and out.fileno() >= 0


def test_a_group_made_later_is_held_and_published_with_the_generations() -> None:
    published: list[tuple[int, str, list[str]]] = []
    held = sever.Held("a", lambda gen, node, text: published.append((gen, node,
                                                                      json.loads(text))))
    held.adopt(1, sever.socket_fds())  # before any generation: nothing to add to
    assert held.groups is None and published == []
    before = sever.socket_fds()
    first = socket.create_server(("127.0.0.1", 0))  # a listener of the generation's groups
    held.formed(1, ("a", "b"), before)
    held.kept(2)
    before = sever.socket_fds()
    later = socket.create_server(("127.0.0.1", 0))  # the script's dist.new_group in gen 2
    held.adopt(2, before)
    ports = [s.getsockname()[1] for s in (first, later)]
    first.close()
    later.close()
    assert [(g, n, [int(e.rsplit(":", 1)[1]) for e in text]) for g, n, text in published] == [
        (1, "a", ports[:1]), (2, "a", ports[:1]), (2, "a", sorted(ports))]
    assert held.groups is not None and held.groups.gens == {1, 2}
    assert len(held.groups.sockets.created) == 2


def test_the_listeners_learned_while_the_store_answered_serve_a_sever_after_it_is_empty(
        sockets: list[socket.socket]) -> None:
    """The pair this node connected to a peer's listener is found by what the peer published.
    Read from an empty store (the one that replaced a store gone dark with the peer), that is
    nothing, and the pair would stay up; what `learn` read before still finds it. `learn` says
    whether it read every peer's, and makes no request before the groups serve the
    generation."""
    peer = socket.create_server(("127.0.0.1", 0))
    sockets.append(peer)
    held = sever.Held("a", lambda gen, node, text: None)
    peer_text = json.dumps([Endpoint(*peer.getsockname()).text()])
    asked: list[tuple[int, list[str]]] = []

    def store(gen: int, nodes: list[str]) -> dict[str, str]:
        asked.append((gen, nodes))
        return {"b": peer_text}

    assert held.learn(1, store) is False and asked == []  # no groups yet: no request
    before = sever.socket_fds()
    out = socket.create_connection(peer.getsockname())
    far, _ = peer.accept()
    sockets += [out, far]
    held.formed(1, ("a", "b", "c"), before)
    assert held.learn(1, store) is False  # c has not published yet
    assert asked == [(1, ["b", "c"])]
    assert held.sever(1, lambda gen, nodes: {}) == 1  # the empty store: learned b's
    far.settimeout(5)
    assert far.recv(1) == b""
