"""The end-to-end benchmark's harness (cupyrope.model_bench): its summary's arithmetic with no GPU, and where
transformers is installed, tiny models on the CPU through the same worker processes the GPU run uses."""

import pytest

from cupyrope import model_bench
from helpers import requires_torch_cuda


def _result(family, variant, round_, prefill, train=None, busy=None):
    ms = {"prefill": prefill} if train is None else {"prefill": prefill, "train": train}
    result = {"family": family, "variant": variant, "round": round_, "ms": ms, "patched": None}
    return result if busy is None else {**result, "busy_ms": {"prefill": busy}}


def test_summary_speedups_are_per_round_and_spread_over_rounds():
    results = [
        _result("qwen3", "transformers", 0, [10.0, 12.0, 11.0]), _result("qwen3", "cupyrope", 0, [5.0, 5.5, 6.0], busy=4.0),
        _result("qwen3", "transformers", 1, [14.0, 14.0, 14.0]), _result("qwen3", "cupyrope", 1, [7.0, 7.0, 7.0], busy=5.0),
        {"family": "qwen3", "variant": "liger", "round": 0, "skipped": "liger-kernel is not installed"},
    ]
    rows = model_bench.summarize(results)
    ours = next(r for r in rows if r["variant"] == "cupyrope")
    assert ours["ms"] == 6.5  # the median of every step of every round
    assert ours["spread"] == (5.5, 7.0)  # the rounds' medians
    assert ours["speedup"] == (2.0, 2.0, 2.0)  # 11 / 5.5 and 14 / 7, each within its round
    assert ours["busy"] == 4.5 and rows[0]["busy"] is None  # the rounds' median; none measured (the CPU)
    assert [r["variant"] for r in rows] == ["transformers", "cupyrope", "liger"]
    assert rows[-1]["why"] == "liger-kernel is not installed"
    text = model_bench.table(rows)
    assert "| qwen3 | prefill | cupyrope | 6.50 (5.50-7.00) | 2.00x (2.00-2.00) | 4.50 |" in text
    assert "| qwen3 | | liger | skipped: liger-kernel is not installed | | |" in text


def test_tiny_models_on_the_cpu_each_variant_in_a_process_of_its_own():
    pytest.importorskip("transformers")
    results = model_bench.run(["qwen3"], model_bench.VARIANTS, ["prefill", "decode", "decode_graph"], rounds=2,
                              steps=1, device="cpu", tiny=True, timeout=300)
    assert [(r["round"], r["variant"]) for r in results] == [
        (0, "transformers"), (0, "cupyrope"), (0, "liger"), (1, "cupyrope"), (1, "liger"), (1, "transformers")]
    patched = [r["patched"] for r in results if r["variant"] == "cupyrope"]
    assert all(p["qk_norm_rope"] == 2 and p["rms_norm"] > 0 and p["skipped"] == 0 for p in patched)
    assert all(r["patched"] is None for r in results if r["variant"] == "transformers")
    timed = [r for r in results if "ms" in r]
    assert all(len(r["ms"]["prefill"]) == 1 and r["ms"]["decode"][0] > 0 and r["ms"]["decode_graph"][0] > 0
               for r in timed)
    rows = model_bench.summarize(results)
    assert {(r["regime"], r["variant"]) for r in rows if "speedup" in r} >= {("prefill", "cupyrope"),
                                                                               ("decode", "cupyrope")}


def test_the_command_line_picks_families_and_regimes(monkeypatch):
    """bench --op model --family F --regime R: only those (repeatable), every variant; by default every one."""
    from cupyrope import __main__ as cli

    seen = []
    monkeypatch.setattr(cli, "_bench", lambda args: seen.append(model_bench.selection(args)) or cli.EXIT_OK)
    assert cli.main(["bench", "--op", "model", "--family", "qwen3", "--regime", "prefill", "--regime", "decode"]) == 0
    assert cli.main(["bench", "--op", "model"]) == 0
    assert seen == [(["qwen3"], model_bench.VARIANTS, ["prefill", "decode"]),
                    (list(model_bench.FAMILIES), model_bench.VARIANTS, list(model_bench.REGIMES))]


@pytest.mark.gpu
@requires_torch_cuda
def test_decode_graph_captures_each_variant_on_the_gpu():
    """decode_graph captures the decode step in a CUDA graph: the patched model's kernels (and every provider's) must
    launch on the capturing stream with nothing that synchronizes, and the replays must run."""
    pytest.importorskip("transformers")
    results = model_bench.run(list(model_bench.FAMILIES), model_bench.VARIANTS, ["decode_graph"], rounds=1, steps=3,
                              device="cuda", tiny=True, timeout=300)
    ran = {(r["family"], r["variant"]) for r in results if "ms" in r}
    assert ran >= {(family, variant) for family in model_bench.FAMILIES for variant in ("transformers", "cupyrope")}, \
        results
    assert all(r["ms"]["decode_graph"][0] > 0 and r["busy_ms"]["decode_graph"] > 0 for r in results if "ms" in r)
    qwen3 = next(r["patched"] for r in results if (r["family"], r["variant"]) == ("qwen3", "cupyrope"))
    assert qwen3["qk_norm_rope"] == 2 and qwen3["skipped"] == 0  # in bf16 too: the model's RoPE is the config's
