"""`spanllm perf validate`: predicted vs measured for every measurement under results/, with the error.

What predicts what, so that no prediction is fitted to the point that validates it:
  allreduce/preset          the preset's constants as shipped (hardware.py). Where hardware.PRESET_FITS
                            names the rows a preset was fitted to (h200x2: every other size, 1 KiB ..
                            16 MiB, of results/h200x2/allreduce_1x2_bf16.json, for nccl, torch one-shot,
                            torch two-shot and nvrar), those rows are left out: this category is the
                            1x2 sizes in between plus every 2x1 row (a topology the preset never saw).
  allreduce/holdout-sizes   per (file, algorithm, topology): fit (calibrate) on every other size,
                            predict the sizes in between.
  allreduce/cross-topology  per algorithm with several topologies (e.g. 1x2 and 2x1): fit on all
                            other topologies, predict this one (both directions on the H200 host).
  Every fit prices nvrar rows with the launch their `ran` column names (one-shot: 1 NVLink phase,
  reduce-scatter: 2, 2x1: 1 recursive-doubling round + a local staging copy); base_us is fitted only
  where the rows hold two phase counts (1x2), else kept from the preset.
  engine/ttft|tpot|e2e      batch / study rows (and study logs without a JSON) from the inference model,
                            held out: rows the preset's engine constants (hardware.EngineCost) were NOT
                            fitted to. All-reduce constants are calibrated on the all-reduce sweeps
                            (separate measurements) when there are any, else the preset's; HBM, GEMM and
                            launch constants are datasheet or separately measured figures.
  engine-fit/ttft|tpot|e2e  the rows hardware.ENGINE_FITS names (h200x2: Llama 3.1 8B, TP=2, NCCL, of the
                            two 8B studies) and hardware.PREFILL_SIZE_FITS (h200x2: 70B TP=2 NCCL, their TTFT
                            fitted the prefill efficiency's size exponent): in-sample, reported apart. The fit
                            is rerun from the files (spanllm.perf.engine_fit) and set beside the preset's
                            constants.
  Each engine record carries a group (model, layout, all-reduce) so that TP / NVRAR / naive PP /
  micro-batched PP rows can be read apart (`summary_by_group`).
  published/check|model     published multi-node all-reduce figures (spanllm.perf.published, published_points.json),
                            each priced on the cluster it names, with the prediction's range over that cluster's
                            guessed constants and whether the figure lies inside it. No constant fitted to them.
  published/loso            the same 'check' figures predicted leave-one-source-out: the hop model (per-call,
                            NVLink-hop and network-hop costs, spanllm.perf.published) fitted to every other source,
                            with a cross-validated range; `published_per_source` says which sources it explains.
  published/unexplained     figures whose own source says the setup was broken: never fitted, reported apart.
Plus the paper's headline claims on the Perlmutter and Vista presets (paper_claims.py).
`spanllm perf validate` exits 2 when the results folder does not exist and 1 when it holds no measurement
the model predicts; it then writes nothing.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from pathlib import Path

from spanllm.model.config import ModelConfigError
from spanllm.perf.allreduce_model import AllReduceModelError, allreduce_time_us, model_name
from spanllm.perf.calibrate import CalibrationError, calibrate
from spanllm.perf.engine_fit import EngineFitError, fit_engine, predict, row_case
from spanllm.perf.hardware import (
    ENGINE_FITS,
    PREFILL_SIZE_FITS,
    PRESET_FITS,
    PRESETS,
    ClusterSpec,
    EngineFitRows,
    PresetFit,
)
from spanllm.perf.inference import InferenceModelError
from spanllm.perf.measurements import AllReduceMeasurement, EngineMeasurement, load_results, result_files
from spanllm.perf.paper_claims import allreduce_ratio_check, e2e_gain_check
from spanllm.perf.published import load_points, loso_records, per_source, point_records

REPORT_NAME = "perf_validation.json"


def rel_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured


def _record(category: str, label: str, predicted: float, measured: float, source: str, fitted_on: str) -> dict:
    return {
        "category": category,
        "label": label,
        "predicted": predicted,
        "measured": measured,
        "rel_error": rel_error(predicted, measured),
        "source": source,
        "fitted_on": fitted_on,
    }


def _ar_label(m: AllReduceMeasurement) -> str:
    return f"{m.algo} {m.nodes}x{m.ranks_per_node} {m.nbytes} B{'' if m.graph else ' eager'}"


def _predict(m: AllReduceMeasurement, cluster: ClusterSpec) -> float:
    algo = model_name(m.algo)
    return allreduce_time_us(
        algo, m.nbytes, cluster, m.nodes, m.ranks_per_node, m.graph, launch=m.launch or None
    )  # other algorithms ignore it


def preset_fitted(m: AllReduceMeasurement, fit: PresetFit | None) -> bool:
    """Whether the preset's constants were fitted to this row (then it cannot validate them)."""
    if fit is None:
        return False
    same_file = Path(m.source).resolve().as_posix().endswith(fit.file) or Path(m.source).as_posix().endswith(fit.file)
    return (
        same_file and f"{m.nodes}x{m.ranks_per_node}" == fit.topology and m.nbytes in fit.sizes and m.algo in fit.algos
    )


def allreduce_records(ms: list[AllReduceMeasurement], cluster: ClusterSpec) -> tuple[list[dict], list[str]]:
    records, skipped = [], []
    usable = []
    pfit = PRESET_FITS.get(cluster.name)
    in_fit = 0
    for m in ms:
        try:
            predicted = _predict(m, cluster)
            usable.append(m)
        except (AllReduceModelError, ValueError) as e:
            skipped.append(f"{_ar_label(m)}: {e}")
            continue
        if preset_fitted(m, pfit):
            in_fit += 1
            continue
        records.append(
            _record(
                "allreduce/preset",
                _ar_label(m),
                predicted,
                m.time_us,
                m.source,
                f"preset {cluster.name}: {pfit.file} {pfit.topology}, every other size"
                if pfit
                else f"preset {cluster.name}",
            )
        )
    if in_fit:
        skipped.append(
            f"allreduce/preset: {in_fit} rows left out, the preset's constants were fitted to them ({pfit.describe()})"
        )
    groups: dict[tuple, list[AllReduceMeasurement]] = {}
    for m in usable:
        groups.setdefault((m.source, m.algo, m.nodes, m.ranks_per_node, m.graph), []).append(m)
    for (source, algo, n, g, _), rows in groups.items():
        sizes = sorted({m.nbytes for m in rows})
        fit_sizes = set(sizes[0::2])
        fit = [m for m in rows if m.nbytes in fit_sizes]
        test = [m for m in rows if m.nbytes not in fit_sizes]
        if not test:
            continue
        try:
            fitted, fits, _ = calibrate(fit, cluster)
        except (CalibrationError, ValueError) as e:
            skipped.append(f"holdout {algo} {n}x{g}: {e}")
            continue
        if not fits:
            skipped.append(f"holdout {algo} {n}x{g}: too few sizes to fit ({len(fit_sizes)})")
            continue
        for m in test:
            records.append(
                _record(
                    "allreduce/holdout-sizes",
                    _ar_label(m),
                    _predict(m, fitted),
                    m.time_us,
                    source,
                    f"sizes {sorted(fit_sizes)}",
                )
            )
    by_algo: dict[str, set] = {}
    for m in usable:
        by_algo.setdefault(m.algo, set()).add((m.nodes, m.ranks_per_node))
    for algo, topos in by_algo.items():
        for topo in sorted(topos) if len(topos) > 1 else []:
            fit = [m for m in usable if m.algo == algo and (m.nodes, m.ranks_per_node) != topo]
            test = [m for m in usable if m.algo == algo and (m.nodes, m.ranks_per_node) == topo]
            try:
                fitted, fits, _ = calibrate(fit, cluster)
            except (CalibrationError, ValueError) as e:
                skipped.append(f"cross-topology {algo} {topo}: {e}")
                continue
            if not fits:
                continue
            others = sorted({f"{a}x{b}" for a, b in topos if (a, b) != topo})
            for m in test:
                records.append(
                    _record(
                        "allreduce/cross-topology",
                        _ar_label(m),
                        _predict(m, fitted),
                        m.time_us,
                        m.source,
                        f"topologies {others}",
                    )
                )
    return records, skipped


def engine_group(case) -> str:
    """'llama3.1-70b TP2 nvrar', 'llama3.1-8b TP1xPP2 m=1', 'llama3.1-8b TP1xPP2 m=2': the subsets read apart."""
    size = case.model.name.split(" ")[0]
    if case.layout.pp > 1:
        return f"{size} TP{case.layout.tp}xPP{case.layout.pp} m={case.layout.micro_batches}"
    return f"{size} TP{case.layout.tp} {case.algo}"


def engine_records(
    es: list[EngineMeasurement],
    cluster: ClusterSpec,
    fitted_on: str,
    fit: EngineFitRows | None = None,
    size_fit: EngineFitRows | None = None,
) -> tuple[list[dict], list[str]]:
    """Predicted vs measured TTFT, TPOT and E2E per engine row; rows `fit` or `size_fit` select go to engine-fit/."""
    records, skipped = [], []
    for e in es:
        r = e.row
        try:
            case = row_case(r)
            est = predict(case, cluster)
        except (KeyError, TypeError, ValueError, ModelConfigError, InferenceModelError, AllReduceModelError) as ex:
            skipped.append(f"{e.source}: engine row {r.get('model')} tp={r.get('tp')} pp={r.get('pp')}: {ex}")
            continue
        in_fit = any(f is not None and f.selects(e.source, r) for f in (fit, size_fit))
        source = e.source + (f":{r['log_line']}" if "log_line" in r else "")
        for metric, predicted in (("ttft", est.ttft_ms), ("tpot", est.tpot_ms), ("e2e", est.e2e_ms)):
            measured = r.get(f"{metric}_ms")
            if measured:
                rec = _record(
                    f"engine{'-fit' if in_fit else ''}/{metric}",
                    case.label,
                    predicted,
                    float(measured),
                    source,
                    fitted_on,
                )
                rec["group"], rec["allreduce_ran"] = engine_group(case), r.get("allreduce_ran")
                records.append(rec)
    return records, skipped


LOSO_CATEGORIES = ("published/loso", "published/unexplained")


def published_acceptance(records: list[dict]) -> dict[str, dict]:
    """The leave-one-source-out records' median |error| and the share inside their range (all, and the
    explained sources only)."""
    out = {}
    for name, cats in (("published/loso+unexplained", LOSO_CATEGORIES), ("published/loso", LOSO_CATEGORIES[:1])):
        rs = [r for r in records if r["category"] in cats]
        if rs:
            out[f"{name} (acceptance)"] = {
                "n": len(rs),
                "median_abs_rel_error": statistics.median(abs(r["rel_error"]) for r in rs),
                "max_abs_rel_error": max(abs(r["rel_error"]) for r in rs),
                "in_range_share": sum(r["in_range"] for r in rs) / len(rs),
            }
    return out


def summarize(records: list[dict]) -> dict[str, dict]:
    return _summary(records, lambda r: r["category"])


def summary_by_group(records: list[dict]) -> dict[str, dict]:
    """Engine records per (category, group): e.g. 'engine/e2e | llama3.1-70b TP1xPP2 m=2'."""
    return _summary([r for r in records if "group" in r], lambda r: f"{r['category']} | {r['group']}")


def _summary(records: list[dict], key) -> dict[str, dict]:
    cats: dict[str, list[float]] = {}
    for r in records:
        cats.setdefault(key(r), []).append(abs(r["rel_error"]))
    return {
        c: {"n": len(v), "median_abs_rel_error": statistics.median(v), "max_abs_rel_error": max(v)}
        for c, v in sorted(cats.items())
    }


def engine_fit_report(eng: list[EngineMeasurement], cluster: ClusterSpec, fit: EngineFitRows | None) -> dict | None:
    """The preset's engine constants beside a refit from the rows it names (None without an engine fit)."""
    if fit is None:
        return None
    rows = [e for e in eng if fit.selects(e.source, e.row)]
    out = {"rows": fit.describe(), "n_rows": len(rows), "preset": asdict(cluster.engine)}
    try:
        refit = fit_engine(rows, cluster, cluster.engine.attends_max_seq_len)
        out.update(refit=asdict(refit.cost), fit_rms_rel_error=refit.rms_rel_error, fitted_rows=list(refit.rows))
    except (EngineFitError, ValueError) as e:
        out["refit"] = f"not rerun: {e}"
    return out


def validate(results_dir: Path, cluster: ClusterSpec) -> dict:
    """The whole report as plain data (also what `spanllm perf validate` writes)."""
    ar, eng, skipped = load_results(result_files(results_dir))
    records, s1 = allreduce_records(ar, cluster)
    engine_cluster, ar_from = cluster, f"all-reduce constants of preset {cluster.name}"
    if ar:
        try:
            engine_cluster, fits, _ = calibrate(ar, cluster)
            if fits:
                ar_from = (
                    f"all-reduce constants calibrated on {len(ar)} all-reduce rows ({', '.join(f.algo for f in fits)})"
                )
        except (CalibrationError, ValueError):
            pass
    efit = ENGINE_FITS.get(cluster.name)
    fitted_on = f"{ar_from}; engine constants " + (f"fitted to {efit.describe()}" if efit else f"of {cluster.name}")
    sfit = PREFILL_SIZE_FITS.get(cluster.name)
    if sfit:
        fitted_on += f"; prefill size exponent fitted to the TTFT of {sfit.describe()}"
    erecs, s2 = engine_records(eng, engine_cluster, fitted_on, efit, sfit)
    pfit = PRESET_FITS.get(cluster.name)
    constants = {
        key: {**asdict(cluster.algo(key)), "fitted_to": pfit.describe() if pfit else "preset"}
        for key in (pfit.constants if pfit else ())
    }
    claims = [
        asdict(c)
        for name in ("perlmutter", "vista")
        for c in (allreduce_ratio_check(PRESETS[name]), e2e_gain_check(PRESETS[name]))
    ]
    points = load_points()
    published = point_records(points) + loso_records(points)
    return {
        "cluster": cluster.name,
        "results_dir": str(results_dir),
        "measurements": len(ar) + len(eng),
        "records": records + erecs,
        "summary": summarize(records + erecs),
        "published": published,
        "summary_published": summarize(published) | published_acceptance(published),
        "published_per_source": per_source([r for r in published if r["category"] in LOSO_CATEGORIES]),
        "summary_by_group": summary_by_group(erecs),
        "paper_claims": claims,
        "skipped": skipped + s1 + s2,
        "preset_constants": constants,
        "preset_fit": asdict(pfit) if pfit else None,
        "engine_fit": engine_fit_report(eng, engine_cluster, efit),
        "method": __doc__.split("\n\n", 1)[1].strip(),
    }
