"""The phase-trace summary (the record layout the NVRAR kernel writes with TRACE=1), on hand-made records."""

import pytest

from spanllm.comm.nvrar.trace import TRACE_PHASES, TRACE_WORDS, summarize


def rec(start, end, total, *phases):
    return [start, end, total, *phases]


def test_summary_converts_cycles_with_the_implied_clock():
    # Two calls of two programs; 2 cycles per ns (2 GHz) overall: 4000 cycles over 2000 ns each.
    call = [rec(1000, 3000, 4000, 1000, 2000, 0, 0, 200, 600), rec(1500, 3500, 4000, 1000, 2400, 0, 0, 200, 200)]
    later = [rec(9000, 11000, 4000, 1200, 2000, 0, 0, 200, 400), rec(9000, 11000, 4000, 1000, 2000, 0, 0, 200, 400)]
    s = summarize([call, later])
    assert s["clock_ghz"] == 2.0 and s["calls"] == 2 and s["programs"] == 2
    assert s["program_us"] == 2.0  # 4000 cycles / 2 GHz
    assert s["kernel_span_us"] == 2.25  # median of 2.5 us (1000..3500) and 2.0 us
    assert s["phases_us"] == {
        "rs_push": 0.5,
        "rs_wait": 1.0,
        "inter_send": 0.0,
        "inter_wait": 0.0,
        "ag_push": 0.1,
        "ag_wait": 0.2,
    }  # medians of the four records, / 2000 cycles per us
    assert tuple(s["phases_us"]) == TRACE_PHASES and TRACE_WORDS == 9


def test_idle_programs_are_left_out_and_bad_records_raise():
    s = summarize([[rec(0, 1000, 1000, 100, 200, 300, 400, 0, 0), [0] * TRACE_WORDS]])
    assert s["programs"] == 1 and s["phases_us"]["inter_wait"] == 0.4
    with pytest.raises(ValueError, match="no trace records"):
        summarize([[[0] * TRACE_WORDS]])
    with pytest.raises(ValueError, match="expected 9"):
        summarize([[[1, 2, 3]]])
