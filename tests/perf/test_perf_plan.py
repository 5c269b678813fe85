import json

from spanllm.cli import main
from spanllm.perf.hardware import PRESETS
from spanllm.perf.inference import Layout, Workload
from spanllm.perf.model_shape import MODELS
from spanllm.perf.plan import best, candidate_layouts, fewest_nodes_that_fit, fits_somewhere, plan
from spanllm.perf.quantization import BF16

DECODE_HEAVY = Workload(batch=8, prompt_len=128, decode_len=1024)
PREFILL_HEAVY = Workload(batch=8, prompt_len=4096, decode_len=4)


def _fast_and_slow_network(make_cluster):
    fast = make_cluster(
        name="fast",
        nic_GBps_per_gpu=100.0,
        nic_latency_us=1.0,
        algos={k: {"net_step_us": 1.0} for k in ("nvrar", "nccl_ring/LL", "nccl_tree/LL")},
    )
    slow = make_cluster(
        name="slow",
        nic_GBps_per_gpu=1.0,
        nic_latency_us=500.0,
        algos={
            k: {"net_step_us": 500.0}
            for k in (
                "nvrar",
                "nccl_ring/LL",
                "nccl_tree/LL",
                "nccl_ring/LL128",
                "nccl_tree/LL128",
                "nccl_ring/Simple",
                "nccl_tree/Simple",
            )
        },
    )
    return fast, slow


def test_candidate_layouts():
    lay = candidate_layouts(MODELS["llama3.1-405b"], PRESETS["perlmutter"], 8, 16)
    pairs = {(l.tp, l.pp) for l in lay}
    assert {(32, 1), (4, 8), (8, 4), (16, 2), (1, 32), (2, 16)} <= pairs
    assert Layout(4, 8, 8) in lay and Layout(4, 8, 1) in lay


def test_tp_wins_decode_heavy_when_allreduce_is_cheap_and_hp_when_it_is_not(make_cluster):
    m = MODELS["llama3.1-70b"]
    fast, slow = _fast_and_slow_network(make_cluster)
    b_fast = best(plan(m, fast, 4, DECODE_HEAVY))
    assert b_fast.layout.pp == 1 and b_fast.layout.tp == 16
    b_slow = best(plan(m, slow, 4, DECODE_HEAVY))
    assert b_slow.layout.tp <= 4 and b_slow.layout.pp > 1  # TP stays inside a node, PP across


def test_hp_wins_prefill_heavy_on_perlmutter():
    rows = plan(MODELS["llama3.1-70b"], PRESETS["perlmutter"], 4, PREFILL_HEAVY)
    by = {(r.layout, r.algo): r.estimate for r in rows}
    assert by[(Layout(4, 4, 4), "nccl")].ttft_ms < by[(Layout(16), "nccl")].ttft_ms


def test_nvrar_vs_nccl_for_multinode_tp_decode_is_a_range_on_perlmutter():
    rows = plan(MODELS["llama3.1-405b"], PRESETS["perlmutter"], 8, DECODE_HEAVY)
    by = {(r.layout, r.algo): r for r in rows}
    nv, nc = by[(Layout(32), "nvrar")], by[(Layout(32), "nccl")]
    # prefill is priced with NCCL for both
    assert nv.estimate.ttft_ms == nc.estimate.ttft_ms
    # the proxied transport's guesses decide it: the two TPOT ranges overlap, and the proxy drives nvrar's
    assert nv.tpot_range.low < nc.tpot_range.high and nc.tpot_range.low < nv.tpot_range.high
    assert nv.e2e_range.low <= nv.estimate.e2e_ms <= nv.e2e_range.high
    assert "transport.proxy_us" in [d.path for d in nv.e2e_range.drivers[:3]]


def test_layouts_that_do_not_fit_are_reported_and_never_best():
    rows = plan(MODELS["llama3.1-405b"], PRESETS["perlmutter"], 4, DECODE_HEAVY)  # 16 x 40 GB < 810 GB
    assert rows and not any(r.fits for r in rows)
    assert best(rows) is None
    rows = plan(MODELS["llama3.1-405b"], PRESETS["perlmutter"], 8, DECODE_HEAVY)
    assert best(rows).fits and rows[0] is best(rows)


def test_cli_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    argv = ["plan", "--model", "llama3.1-8b", "--cluster", "h200x2", "--nodes", "1", "--batch", "4", "--prompt", "256"]
    assert main([*argv, "--decode", "32", "--json", str(out), "--plot", str(png)]) == 0
    doc = json.loads(out.read_text())
    assert doc["best"]["layout"] == doc["rows"][0]["layout"]
    assert {"ttft_ms", "tpot_ms", "e2e_ms", "decode_ms", "memory_GB", "fits"} <= set(doc["rows"][0])
    assert png.stat().st_size > 1000
    assert "best:" in capsys.readouterr().out


def test_fewest_nodes_that_fit_is_the_first_node_count_with_a_fitting_layout():
    model, cluster = MODELS["llama3.1-405b"], PRESETS["perlmutter"]  # 4 x 40 GB a node
    fits = [n for n in range(1, 17) if fits_somewhere(model, cluster, n, DECODE_HEAVY, True, BF16)]
    first = fits[0]
    assert fits == list(range(first, 17))  # memory per GPU only falls as nodes are added
    for start in range(1, first):
        assert fewest_nodes_that_fit(model, cluster, start, DECODE_HEAVY, True, BF16, 4096) == first
    assert fewest_nodes_that_fit(model, cluster, 1, DECODE_HEAVY, True, BF16, first - 1) is None  # under the limit


def test_cli_no_layout_fits_says_what_would(capsys):
    base = ["plan", "--model", "llama3.1-405b", "--batch", "8", "--prompt", "128", "--decode", "1024"]
    n = fewest_nodes_that_fit(MODELS["llama3.1-405b"], PRESETS["dgx-h100"], 1, DECODE_HEAVY, True, BF16, 4096)
    assert main([*base, "--cluster", "dgx-h100", "--nodes", "1"]) == 1
    last = " ".join(capsys.readouterr().out.split()).rsplit("no layout fits in GPU memory: ", 1)[1]
    assert last == (
        f"--nodes {n} (the fewest dgx-h100 nodes on which a layout fits); or --quantization fp8 (FP8 weights fit on 1 "
        "node(s)); or a smaller model"
    )
    assert main([*base, "--cluster", "h200x2", "--nodes", "1", "--quantization", "fp8"]) == 1
    last = " ".join(capsys.readouterr().out.split()).rsplit("no layout fits in GPU memory: ", 1)[1]
    assert last == "a cluster with more GPUs (h200x2 is one node without a network); or a smaller model"
