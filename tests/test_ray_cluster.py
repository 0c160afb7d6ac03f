"""A simulation that outgrows one machine runs on an existing Ray cluster: a head node and a worker node,
each started by `ray start` as its own process (as on two machines), and a SuperLink whose simulations attach
to that cluster through RAY_ADDRESS. The run must complete and ClientApp work must run on both nodes."""

import json
import re

import socket

from fedskew.testing import launch
from fedskew.testing.launch import RayCluster, SimulationSuperLink, free_port

# One round on two sites; each node holds one CPU, so each of the two ClientApp actors lives on its own node.
TINY = {"method": "fednca", "num-server-rounds": 1, "batch-size": 64, "val-fraction": 0.2, "min-site-size": 5}
SITE_LINE = re.compile(r"\(ClientAppActor pid=(\d+)(?:, ip=([\d.]+))?\)\S*\s+site (\d+): round 1 trained")


def test_a_fednca_simulation_on_a_two_node_ray_cluster_trains_sites_on_both_nodes(tmp_path):
    with RayCluster(worker_nodes=1, cpus_per_node=1) as cluster:
        assert len(cluster.alive_nodes()) == 2
        with SimulationSuperLink(tmp_path / "flwr-home", ray_address=cluster.address) as superlink:
            outcome = superlink.run_app({**TINY, "results-dir": str(tmp_path / "results")}, num_supernodes=2)
    assert outcome.completed, outcome.output[-4000:]
    (run,) = [p for p in (tmp_path / "results").iterdir() if p.is_dir()]
    assert json.loads((run / "summary.json").read_text())["rounds_completed"] == 1
    # Ray prefixes a line from another node than the driver's with that node's address: the worker node's
    # is 127.0.0.2, the head node's (where the simulation's driver runs) carries none.
    trained = {(int(site), ip) for _pid, ip, site in SITE_LINE.findall(outcome.output)}
    assert {site for site, _ in trained} == {0, 1}, outcome.output[-4000:]
    assert {ip for _, ip in trained} == {"", "127.0.0.2"}, trained


def test_free_port_never_hands_out_a_port_twice_even_when_the_os_offers_it_again(monkeypatch):
    # The OS may give the port it just released to the next bind (a Ray node then refused to start: two of
    # its components had the same port). A socket that always binds the same port stands in for that.
    offered = iter([50001, 50001, 50001, 50002])

    class Reused(socket.socket):
        def getsockname(self):
            return ("127.0.0.1", next(offered))

    monkeypatch.setattr(launch, "_PORTS_HANDED_OUT", set())
    monkeypatch.setattr(launch.socket, "socket", Reused)
    assert [free_port(), free_port()] == [50001, 50002]
