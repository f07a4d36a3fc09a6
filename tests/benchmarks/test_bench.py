"""pytest --benchmark-only: cupyrope against the installed peers (see cupyrope/bench.py for the method).

Each benchmark's pedantic timing is one call plus a synchronize; extra_info carries the honest numbers
(GPU time per call from CUDA-graph replays with rotated inputs, eager time per call, GB/s and % of the
copy bandwidth measured in the same run). CUPYROPE_BENCH_FULL=1 runs the full grids.
"""

import os

import pytest

from helpers import requires_torch_cuda

torch = pytest.importorskip("torch")
bench = pytest.importorskip("cupyrope.bench")

pytestmark = [pytest.mark.gpu, requires_torch_cuda]
FULL = os.environ.get("CUPYROPE_BENCH_FULL") == "1"
ROPE_PROVIDERS = ["cupyrope vector", "cupyrope vector (no PDL)", "cupyrope scalar", "cupyrope vector cache", "cupyrope scalar cache",
                  "cupyrope rope_qk", "torch eager (recompute cos/sin)", "torch eager (cos/sin cache)",
                  "torch.compile (cos/sin cache)", "cupyrope dropin (transformers cos/sin)", "liger"]
RMS_PROVIDERS = ["cupyrope", "cupyrope (no PDL)", "F.rms_norm", "liger"]
ADD_PROVIDERS = ["cupyrope", "cupyrope (no PDL)", "x + r, F.rms_norm", "torch.compile", "liger"]
FP8_PROVIDERS = ["cupyrope", "cupyrope (no PDL)", "F.rms_norm, quantize", "torch.compile"]
LAYER_NORM_PROVIDERS = ["cupyrope", "cupyrope (no PDL)", "F.layer_norm", "torch.compile", "liger"]


@pytest.fixture(scope="session")
def copy_gbps():
    return bench.copy_bandwidth_gbps(torch)


def _run(benchmark, case, name, providers, copy_gbps):
    if name not in providers:
        pytest.skip(f"{name} is not installed")
    copies = [case.make() for _ in range(bench.copies_for(case.bytes_moved))]
    try:
        fns = [providers[name](d) for d in copies]
    except ValueError as error:
        pytest.skip(str(error))
    try:
        bench.check(case, name, copies[0], fns[0], torch)
    except AssertionError as error:
        if name.startswith("cupyrope"):
            raise
        pytest.skip(f"excluded: {error}")  # a peer's wrong answer is reported, never ranked
    autograd = case.op in bench.BACKWARD_OPS and not name.startswith("cupyrope")
    gpu_us = bench.gpu_time_us(torch, fns, capture=not autograd)
    eager_us = bench.eager_time_us(torch, fns)
    gbps = case.bytes_moved / gpu_us / 1e3
    benchmark.group = f"{case.op} {case.label} {case.dtype}"
    benchmark.extra_info.update(bytes=case.bytes_moved, gpu_us_per_call=round(gpu_us, 2),
                                eager_us_per_call=round(eager_us, 2), gbps=round(gbps, 1),
                                pct_copy_bw=round(100 * gbps / copy_gbps, 1), copy_gbps=round(copy_gbps))
    benchmark.pedantic(lambda: (fns[0](), torch.cuda.synchronize()), rounds=20, warmup_rounds=2)


@pytest.mark.parametrize("name", ROPE_PROVIDERS)
@pytest.mark.parametrize("case", bench.rope_cases(torch, FULL), ids=lambda c: f"{c.label}-{c.dtype}")
def test_rope(benchmark, case, name, copy_gbps):
    _run(benchmark, case, name, bench.rope_providers(torch), copy_gbps)


@pytest.mark.parametrize("name", RMS_PROVIDERS)
@pytest.mark.parametrize("case", bench.rms_cases(torch, FULL), ids=lambda c: f"{c.op}-{c.label}-{c.dtype}")
def test_rms_norm(benchmark, case, name, copy_gbps):
    _run(benchmark, case, name, bench.rms_providers(torch, case.op == "rms_bwd"), copy_gbps)


@pytest.mark.parametrize("name", ADD_PROVIDERS)
@pytest.mark.parametrize("case", bench.add_cases(torch, FULL), ids=lambda c: f"{c.op}-{c.label}-{c.dtype}")
def test_add_rms_norm(benchmark, case, name, copy_gbps):
    _run(benchmark, case, name, bench.add_providers(torch, case.op == "add_bwd"), copy_gbps)


@pytest.mark.parametrize("name", FP8_PROVIDERS)
@pytest.mark.parametrize("case", bench.fp8_cases(torch, FULL), ids=lambda c: f"{c.op}-{c.label}-{c.dtype}")
def test_rms_norm_fp8(benchmark, case, name, copy_gbps):
    _run(benchmark, case, name, bench.fp8_providers(torch, case.op), copy_gbps)


@pytest.mark.parametrize("name", LAYER_NORM_PROVIDERS)
@pytest.mark.parametrize("case", bench.layer_norm_cases(torch, FULL), ids=lambda c: f"{c.op}-{c.label}-{c.dtype}")
def test_layer_norm(benchmark, case, name, copy_gbps):
    _run(benchmark, case, name, bench.layer_norm_providers(torch, case.op == "ln_bwd"), copy_gbps)


@pytest.mark.parametrize("family", ["llama-3", "qwen3"])
def test_model(benchmark, family):
    """Whole transformers models (bench --op model): unpatched, patched by cupyrope and by Liger, each in a process
    of its own, two rounds. extra_info holds each variant's step times and speedups by regime; the pedantic time is
    the harness's whole run."""
    pytest.importorskip("transformers")
    from cupyrope import model_bench

    results = []
    benchmark.pedantic(lambda: results.extend(model_bench.run([family], model_bench.VARIANTS,
                                                              list(model_bench.REGIMES), rounds=2)),
                       rounds=1, iterations=1)
    rows = model_bench.summarize(results)
    benchmark.group = f"model {family}"
    benchmark.extra_info["rows"] = rows
    assert all(r.get("speedup") for r in rows if r["variant"] == "cupyrope"), rows
