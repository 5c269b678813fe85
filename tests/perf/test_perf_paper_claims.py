import pytest

from spanllm.perf.allreduce_model import allreduce_time_us
from spanllm.perf.hardware import PRESETS
from spanllm.perf.paper_claims import RATIO_BAND, allreduce_ratio_check, e2e_gain_check


def test_ratio_check_is_the_ratio_of_the_two_models():
    c = PRESETS["perlmutter"]
    chk = allreduce_ratio_check(c, node_counts=(8,), sizes=(1 << 17,))
    expected = allreduce_time_us("nccl", 1 << 17, c, 8) / allreduce_time_us("nvrar", 1 << 17, c, 8)
    assert chk.predicted_min == chk.predicted_max == pytest.approx(expected)
    assert chk.band == RATIO_BAND


@pytest.mark.parametrize("name", ["perlmutter", "vista"])
def test_claims_are_computed_on_both_presets(name):
    ratio, gain = allreduce_ratio_check(PRESETS[name]), e2e_gain_check(PRESETS[name])
    assert ratio.predicted_min <= ratio.predicted_median <= ratio.predicted_max
    assert ratio.predicted_max > 1.0  # NVRAR wins somewhere in the 128 KB - 2 MB window
    assert gain.predicted_max > 0.0 and "nodes" in gain.where_max


def test_perlmutter_ratio_with_the_proxied_transport_is_below_the_paper_band():
    """Recorded outcome with the shipped constants (CPU-proxied libfabric rounds, NCCL at its tuner's IB figures):
    the paper's 1.9-3.6x is not reproduced; update when a measured sweep replaces the guesses."""
    chk = allreduce_ratio_check(PRESETS["perlmutter"])
    assert not chk.consistent and chk.predicted_median < RATIO_BAND[0]
