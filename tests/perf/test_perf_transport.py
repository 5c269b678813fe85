import pytest

from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.hardware import PRESETS, KernelCost, ll8_cost
from spanllm.perf.transport import TRANSPORTS, Transport, TransportError, get_transport


def test_gpu_initiated_put_and_signal_pay_no_proxy():
    t = Transport("g", gpu_initiated=True, post_us=1.0, proxy_us=0.0)
    assert t.put_us(2.0) == pytest.approx(3.0)  # post + wire
    assert t.signal_us(2.0) == pytest.approx(1.0)  # ordered behind the put: only its own post
    assert t.round_us(2.0) == pytest.approx(4.0)


def test_proxied_transport_pays_the_hand_off_on_every_put_and_signal():
    t = Transport("p", gpu_initiated=False, post_us=0.5, proxy_us=3.0)
    assert t.put_us(2.0) == pytest.approx(0.5 + 3.0 + 2.0)
    assert t.signal_us(2.0) == pytest.approx(0.5 + 3.0)
    # a signal that waits for the put's completion pays one round trip more (2 x one-way)
    w = Transport("w", gpu_initiated=False, post_us=0.5, proxy_us=3.0, signal_waits=True)
    assert w.signal_us(2.0) == pytest.approx(3.5 + 4.0) and w.round_us(2.0) == pytest.approx(5.5 + 7.5)


def test_transport_errors_name_the_fix():
    with pytest.raises(TransportError, match="proxy_us=2.0 but gpu_initiated=True"):
        Transport("x", gpu_initiated=True, post_us=1.0, proxy_us=2.0)
    with pytest.raises(TransportError, match="post_us=-1"):
        Transport("x", gpu_initiated=False, post_us=-1.0, proxy_us=0.0)
    with pytest.raises(TransportError, match="unknown NVSHMEM transport 'verbs'.*ibgda"):
        get_transport("verbs")


def test_presets_use_their_transports_and_the_h200_kernel():
    assert PRESETS["perlmutter"].transport.name == "libfabric" and not PRESETS["perlmutter"].transport.gpu_initiated
    assert PRESETS["vista"].transport.name == "ibrc"
    assert PRESETS["dgx-h100"].transport.gpu_initiated
    for name in ("dgx-h100", "dgx-h200", "perlmutter", "vista"):
        assert PRESETS[name].kernel == PRESETS["h200x2"].kernel  # carried, not zero
        assert PRESETS[name].algos["nvrar"].base_us == pytest.approx(3.130)


def test_perlmutter_round_hand_computed():
    # kernel phase 0.765; put 0.3 + 3.0 + 3.2 = 6.5; signal waits for the put: 0.3 + 3.0 + 2 x 3.2 = 9.7
    c = PRESETS["perlmutter"]
    assert c.algos["nvrar"].net_step_us == pytest.approx(0.765 + 6.5 + 9.7)
    # 4 nodes x 4, 4 KiB, reduce-scatter launch: graph node 0.6 + call 3.13 + 2 NVLink phases x 0.765
    # + LL8 bytes 2 x 3/4 x 4096 x 2 / (300 GB/s x 0.813) + 2 rounds x 16.965 + 2 x 1024 x 2 / (25 GB/s x 0.813)
    # + staging 2 x 1024 x 2 B at 1555 x 0.85 GB/s
    m = 4096
    want = (
        0.6
        + 3.13
        + 2 * 0.765
        + 2 * 0.75 * m * 2 / (300e3 * 0.813)
        + 2 * 16.965
        + 2 * 1024 * 2 / (25e3 * 0.813)
        + 2 * 1024 * 2 / (1555e3 * 0.85)
    )
    assert allreduce_time_us("nvrar", m, c, 4, launch="rs/b4x256w4") == pytest.approx(want)


def test_ll8_cost_separates_kernel_link_and_transport():
    k = KernelCost(call_us=2.0, phase_us=0.5, bw_efficiency=0.7)
    cost = ll8_cost(1.3, 2.0, k, TRANSPORTS["ibgda"])
    assert (cost.base_us, cost.nvlink_step_us, cost.bw_efficiency) == (2.0, 0.5, 0.7)
    assert cost.net_step_us == pytest.approx(0.5 + (1.0 + 2.0) + 1.0)
