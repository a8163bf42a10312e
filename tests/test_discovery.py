"""Topology discovery from the downward-API labels file (the format the kubelet writes)."""

from __future__ import annotations

import pytest

from kuberl.weights.discovery import format_labels, own_topology, parse_labels, topology_from_labels
from kuberl.weights.plan import RankTopology

KUBELET_FILE = (
    'app.kubernetes.io/managed-by="kuberl-operator"\n'
    'kuberl.io/fabric="nvl72-clique-\\"7\\""\n'
    'kuberl.io/node="gpu-node-3"\n'
    'kuberl.io/role="trainer"\n'
    'kuberl.io/zone="eu-west-1a"\n'
)


def test_labels_file_parses_go_quoted_values_and_round_trips():
    labels = parse_labels(KUBELET_FILE)
    assert labels["kuberl.io/fabric"] == 'nvl72-clique-"7"'
    assert topology_from_labels(labels) == RankTopology("gpu-node-3", 'nvl72-clique-"7"', "eu-west-1a")
    assert parse_labels(format_labels(labels)) == labels


def test_node_name_env_stands_in_until_the_operator_labels_the_pod(tmp_path):
    path = tmp_path / "labels"
    path.write_text('kuberl.io/role="inference"\n')
    assert own_topology(path, "node-a") == RankTopology("node-a")
    path.write_text(KUBELET_FILE)
    assert own_topology(path, "node-a").node == "gpu-node-3"
    with pytest.raises(ValueError, match=r"kuberl\.io/node"):
        topology_from_labels({})
