"""A round-number cluster for hand-computed cases."""

import pytest

from spanllm.perf.hardware import cluster_from_dict

ROUND = dict(
    name="round",
    description="round numbers for hand calculations",
    gpu="test",
    gpus_per_node=4,
    gpu_memory_GB=100.0,
    hbm_GBps=1000.0,
    hbm_efficiency=1.0,
    bf16_TFLOPs=100.0,
    gemm_efficiency=1.0,
    nvlink_GBps=100.0,
    nvlink_latency_us=1.0,
    nic_GBps_per_gpu=10.0,
    nic_latency_us=4.0,
    graph_node_us=0.5,
    kernel_launch_us=5.0,
)
LL8 = dict(base_us=0.0, nvlink_step_us=2.0, net_step_us=5.0, wire_factor=2.0, bw_efficiency=1.0)


@pytest.fixture
def round_cluster():
    return cluster_from_dict({**ROUND, "algos": {"nvrar": LL8, "recursive_doubling": LL8}})


@pytest.fixture
def make_cluster():
    """The round cluster with some fields replaced."""
    return lambda **overrides: cluster_from_dict({**ROUND, **overrides})


def _row(algo, size, time_us, topology="1x2", ran=None, wrong=0):
    n, g = map(int, topology.split("x"))
    return {
        "size": size,
        "count": size // 2,
        "type": "bfloat16",
        "redop": "sum",
        "algo": algo,
        "ran": ran or algo,
        "world_size": n * g,
        "ranks_per_node": g,
        "topology": topology,
        "time_us": time_us,
        "time_us_p99": time_us * 1.1,
        "algbw_GBps": 0,
        "busbw_GBps": 0,
        "wrong": wrong,
        "graph": True,
    }


def _bench_doc(rows):
    return {
        "kind": "allreduce",
        "machine": {},
        "versions": {},
        "settings": {"ranks_per_node": 2, "world_size": 2, "graph": True, "dtype": "bfloat16"},
        "rows": rows,
    }


@pytest.fixture
def bench():
    """(row, doc): build rows and documents of the `spanllm bench allreduce --json` schema."""
    return _row, _bench_doc
