"""NVSHMEM remote transports: what one put and one signal cost between GPUs on different hosts.

NVRAR's inter-node rounds are NVSHMEM puts followed by a signal (the partner polls the signal, then
reduces). Who drives the NIC decides what each of those operations pays:

  GPU-initiated (IBGDA, InfiniBand only)  a GPU thread writes the work request and rings the NIC's
      doorbell itself: each operation pays `post_us` on the GPU, then the wire.
  CPU-proxied (IBRC, UCX, libfabric)      the GPU writes a request into a host-visible queue and a
      proxy thread on the CPU polls it and posts it to the NIC: each operation pays the hand-off
      (`post_us` + `proxy_us`). Slingshot-11 has no GPU-initiated path, so NVSHMEM runs on libfabric
      (cxi provider) through the proxy there.

One round of recursive doubling, as the partner sees it (nic_latency_us: the fabric's one-way small-put
latency, a link constant of the cluster, ClusterSpec.nic_latency_us):

  put_us    = post_us + proxy_us + nic_latency_us
  signal_us = post_us + proxy_us                         the signal follows the put on the same ordered
              [+ 2 x nic_latency_us if signal_waits]     queue pair; where the transport cannot order it
                                                         behind the put, it is sent only once the put's
                                                         completion came back (one round trip more)
  round_us  = put_us + signal_us

Each constant carries its source or says it is a guess; the guesses have ranges in the presets
(ClusterSpec.ranges, `transport.<field>`), which `spanllm plan` turns into ranges of its predictions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class TransportError(ValueError):
    """An unknown transport or an impossible transport constant."""


@dataclass(frozen=True)
class Transport:
    name: str  # NVSHMEM_REMOTE_TRANSPORT value (ibgda: NVSHMEM_IB_ENABLE_IBGDA=1 on top of the IB transports)
    gpu_initiated: bool
    post_us: float  # GPU-side cost to issue one operation (build a work request / enqueue a proxy request)
    proxy_us: float  # CPU proxy thread's hand-off per operation; 0 when GPU-initiated
    signal_waits: bool = False  # the signal is sent only after the put's completion came back

    def __post_init__(self) -> None:
        for name in ("post_us", "proxy_us"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise TransportError(
                    f"Transport({self.name!r}).{name}={v!r} must be a finite number >= 0 (microseconds)"
                )
        if self.gpu_initiated and self.proxy_us:
            raise TransportError(
                f"Transport({self.name!r}): proxy_us={self.proxy_us} but gpu_initiated=True; "
                "a GPU-initiated transport has no proxy hand-off (set proxy_us=0)"
            )

    def put_us(self, nic_latency_us: float) -> float:
        """One put, from the kernel's issue to the data visible at the partner."""
        return self.post_us + self.proxy_us + nic_latency_us

    def signal_us(self, nic_latency_us: float) -> float:
        """The signal that follows a put, beyond the put itself."""
        return self.post_us + self.proxy_us + (2 * nic_latency_us if self.signal_waits else 0.0)

    def round_us(self, nic_latency_us: float) -> float:
        """One recursive-doubling round's communication: a put and its signal."""
        return self.put_us(nic_latency_us) + self.signal_us(nic_latency_us)


# Sources (cited by the presets that use them):
# [NVSHMEM docs] https://docs.nvidia.com/nvshmem/release-notes-install-guide/best-practice-guide/performance.html :
#   IBGDA moves the whole submission to the GPU, "a thread on the GPU cannot fill out a work queue entry as
#   quickly as a CPU thread", so a single message sees a higher issue latency than a CPU post; no proxy hop.
#   Environment variables: NVSHMEM_REMOTE_TRANSPORT defaults to ibrc (ucx, libfabric, ibdevx, none);
#   NVSHMEM_LIBFABRIC_PROVIDER defaults to cxi (Slingshot).
# [pplx-kernels] https://github.com/ppl-ai/pplx-kernels README: 1-token MoE dispatch 102-126 us with IBGDA vs
#   290-525 us with IBRC on EP16-EP128 (combine 55-63 vs 86-787 us): the proxy path costs 2.8-4.2x for tiny
#   payloads; per-operation hand-off not stated. proxy_us below is a guess sized by it.
# [LCI #190] https://github.com/uiuc-hpc/lci/pull/190 (HPE Slingshot-11, libfabric 2.6.0 cxi, 2 nodes): median
#   per-put latency 6.44 us with fi_writedata (put + immediate, 4-192 B), 12.8 us with a put followed by a
#   separate notification: a signal that is not fused with the put waits for the put's completion.
TRANSPORTS: dict[str, Transport] = {
    # [assumed] post_us: GPU-built work request + doorbell, a little slower than a CPU post ([NVSHMEM docs])
    "ibgda": Transport("ibgda", gpu_initiated=True, post_us=1.0, proxy_us=0.0),
    # [assumed] proxy_us: host proxy thread polls the GPU's request and posts it ([pplx-kernels] sizes it)
    "ibrc": Transport("ibrc", gpu_initiated=False, post_us=0.3, proxy_us=3.0),
    # [assumed] UCX adds its own software layer over the same proxy hand-off
    "ucx": Transport("ucx", gpu_initiated=False, post_us=0.3, proxy_us=4.0),
    # [assumed] proxy as IBRC; [LCI #190] the signal waits for the put's completion on cxi
    "libfabric": Transport("libfabric", gpu_initiated=False, post_us=0.3, proxy_us=3.0, signal_waits=True),
}


def get_transport(name: str) -> Transport:
    if name not in TRANSPORTS:
        raise TransportError(
            f"unknown NVSHMEM transport {name!r}; known: {', '.join(TRANSPORTS)} "
            "(NVSHMEM_REMOTE_TRANSPORT, or ibgda for NVSHMEM_IB_ENABLE_IBGDA=1)"
        )
    return TRANSPORTS[name]
