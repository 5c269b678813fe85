"""All-reduce library. `create(name, group, topology)` builds a backend; see `ALGORITHMS`."""

from spanllm.comm.base import AllReduce, AllReduceError, AllReduceInputError, Capability
from spanllm.comm.registry import ALGORITHMS, algorithm_class, algorithms_for_device, create
from spanllm.comm.topology import Topology, TopologyError

__all__ = [
    "ALGORITHMS",
    "AllReduce",
    "AllReduceError",
    "AllReduceInputError",
    "Capability",
    "Topology",
    "TopologyError",
    "algorithm_class",
    "algorithms_for_device",
    "create",
]
