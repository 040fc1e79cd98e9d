"""The ring's port rule (ringtrain.ports): one definition of where a member's side channel
listens, which the operator's pods, the trainer's listener and `ringtrain run` all follow."""

from __future__ import annotations

import socket

from ringtrain.ports import free_ring_ports, member_ports, side_channel_port
from ringtrain_localrun import plan
from ringtrain_operator import manifests


def test_the_side_channel_listens_on_the_ring_port_plus_one_in_the_pod_too():
    assert side_channel_port(2222) == 2223 == manifests.RING_DATA_PORT
    assert member_ports(manifests.RING_PORT) == (manifests.RING_PORT, manifests.RING_DATA_PORT)


def test_free_ring_ports_leave_every_side_channel_free_and_no_member_on_anothers():
    ports = free_ring_ports(8)
    both = [p for port in ports for p in member_ports(port)]
    assert len(set(both)) == len(both) == 16
    for p in both:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free right after the call


def test_free_ring_ports_avoid_the_ports_already_taken():
    first = free_ring_ports(3)
    taken = {p for port in first for p in member_ports(port)}
    again = free_ring_ports(20, taken=taken)
    assert not taken & {p for port in again for p in member_ports(port)}


def test_ringtrain_runs_allocator_never_hands_out_a_port_twice_or_onto_a_side_channel():
    port = plan.port_allocator()
    ports = [port() for _ in range(30)]
    both = [p for q in ports for p in member_ports(q)]
    assert len(set(both)) == len(both)
