"""fadev.sweep on a multi-node Ray cluster, simulated on this machine by Ray's own test cluster
(``ray.cluster_utils.Cluster``: a head without CPUs and two worker nodes of one CPU each): a worker node
removed while the sweep runs -> its tasks are retried on the other node, the sweep completes, and the
results file holds every point exactly once with the same values as a local run. Skipped without Ray."""
from __future__ import annotations

import os
import threading
import time

import pandas as pd
import pytest

import fadev
from fadev import sweep

import helpers

ray = pytest.importorskip("ray")
if "libasan" in os.environ.get("LD_PRELOAD", ""):  # CI's sanitizer run: Ray's own raylet does not start
    pytest.skip("Ray's processes do not start with the sanitizers preloaded", allow_module_level=True)
cluster_utils = pytest.importorskip("ray.cluster_utils")

TIMING = ["wall_s", "test_s"]


def _values(df):
    return df.drop(columns=TIMING).set_index("key").sort_index()


@pytest.fixture
def cluster(monkeypatch):
    # Ray's processes inherit PYTHONPATH: its workers import this fadev and tests/helpers.py
    paths = [os.path.dirname(os.path.dirname(fadev.__file__)), os.path.dirname(helpers.__file__)]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]))
    c = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = [c.add_node(num_cpus=1) for _ in range(2)]
        ray.init(address=c.address, log_to_driver=False)
        c.wait_for_nodes()
        yield c, nodes
    finally:
        ray.shutdown()
        c.shutdown()


def test_node_removed_mid_sweep(cluster, tmp_path):
    c, nodes = cluster
    n = 12
    pts = sweep.validate(sweep.expand({"seed": list(range(n))}, base={"N": 24, "D": 8, "heads": 2}))
    out = tmp_path / "cluster.jsonl"
    result = {}

    def drive():  # the driver's sweep, in a thread, while the main thread takes a node away
        try:
            result["rows"] = sweep.drive({sweep.point_key(p): p for p in pts}, helpers.slow_evaluate, sweep.point_key,
                                         out, executor="ray", workers=4, progress=False)
        except BaseException as e:
            result["error"] = e

    thread = threading.Thread(target=drive)
    thread.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (out.exists() and out.read_bytes().count(b"\n") >= 2):
        time.sleep(0.005)
    assert thread.is_alive(), f"the sweep ended before a node could be removed: {result}"
    c.remove_node(nodes[0])  # its running task dies with the node; Ray retries it on the other node
    thread.join(timeout=300)
    assert not thread.is_alive() and "error" not in result, result
    rows = result["rows"]
    assert all(r.get("error") is None for r in rows.values()), [r["error"] for r in rows.values() if r.get("error")]
    lines = out.read_bytes().decode().splitlines()
    on_disk = sweep.load(out)
    assert len(lines) == len(on_disk) == n and on_disk["key"].is_unique  # no row lost, none twice
    pd.testing.assert_frame_equal(_values(on_disk), _values(sweep.run(pts, progress=False)))
