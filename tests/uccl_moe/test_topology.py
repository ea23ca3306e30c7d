"""Ranks-per-node detection: emulation variable, LOCAL_WORLD_SIZE, hostnames, and the errors for bad layouts."""

from __future__ import annotations

import pytest

from uccl_moe import InvalidUsageError
from uccl_moe.topology import Topology, detect


def test_emulated_nodes_split_the_group(monkeypatch):
    monkeypatch.setenv("UCCL_MOE_EMULATE_NODES", "2")
    t = detect(None, rank=3, num_ranks=4)
    assert (t.ranks_per_node, t.num_nodes, t.node, t.local_rank, t.emulated) == (2, 2, 1, 1, True)


def test_emulation_must_divide(monkeypatch):
    monkeypatch.setenv("UCCL_MOE_EMULATE_NODES", "3")
    with pytest.raises(InvalidUsageError, match="UCCL_MOE_EMULATE_NODES=3 does not divide the group of 4 ranks"):
        detect(None, 0, 4)


def test_local_world_size(monkeypatch):
    monkeypatch.delenv("UCCL_MOE_EMULATE_NODES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    t = detect(None, rank=9, num_ranks=16)
    assert (t.ranks_per_node, t.num_nodes, t.node, t.local_rank) == (8, 2, 1, 1)
    # a sub-group smaller than a node lives inside one node
    assert detect(None, 1, 4).num_nodes == 1


def test_local_world_size_must_be_an_int(monkeypatch):
    monkeypatch.delenv("UCCL_MOE_EMULATE_NODES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(InvalidUsageError, match='LOCAL_WORLD_SIZE="eight" is not an integer'):
        detect(None, 0, 8)


def test_uneven_nodes_and_too_many_local_ranks_are_rejected():
    with pytest.raises(InvalidUsageError, match="same number of ranks"):
        Topology(0, 6, 4)
    with pytest.raises(InvalidUsageError, match="more than the 8"):
        Topology(0, 16, 16)


def test_single_process_is_one_node(monkeypatch):
    monkeypatch.delenv("UCCL_MOE_EMULATE_NODES", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    t = detect(None, 0, 1)
    assert (t.num_nodes, t.ranks_per_node) == (1, 1)
