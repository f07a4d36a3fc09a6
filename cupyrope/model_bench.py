"""End-to-end timing of transformers models: unpatched, with cupyrope's ``patch_transformers``, and with Liger's
like-for-like patch (its RoPE and RMSNorm only). ``python -m cupyrope bench --op model``.

Each (family, variant) runs in a process of its own, so that a module-level patch (Liger's replaces transformers'
classes and functions) cannot leak into another variant's numbers. A worker builds the model from a config with
random bf16 weights and sdpa attention, runs each regime a few times to warm up, then times ``steps`` steps with
CUDA events (a step's GPU timeline, host gaps included), then the GPU's busy time in a step (its kernels' and copies'
times summed, by the torch profiler: what the kernels cost without the host's gaps, which dominate decode at this
size), and prints one JSON line. The parent takes the variants in turns over ``rounds`` rounds and reports, per family
and regime, each variant's median step time, its spread over the rounds, its speedup over the unpatched model in the
same round, and its median busy time.

Regimes: ``prefill`` (one sequence, no grad, full logits), ``train`` (forward and backward of the language-model loss,
no optimizer), ``decode`` (one token for each of a batch of sequences, with the KV cache of a prompt; transformers'
host time between the kernels dominates it at this size), ``decode_graph`` (the same step on a static cache, captured
in a CUDA graph and replayed, as serving engines run decode: the kernels' time without the host's).
"""

import json
import statistics
import subprocess
import sys
import time

# A ~1B Llama-shaped decoder (hidden 2048, 16 layers, GQA 32/8 heads of 64, intermediate 5632).
SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=5632, vocab_size=32000, max_position_embeddings=16384)
TINY_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=128, max_position_embeddings=256)
# family: (config class, model class, config options). Qwen3 adds per-head q_norm / k_norm (QK-norm).
FAMILIES = {
    "llama-3": ("LlamaConfig", "LlamaForCausalLM", {"rope_theta": 500000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"rope_theta": 1000000.0, "head_dim": None}),
}
LIGER_PATCHES = {"llama-3": "apply_liger_kernel_to_llama", "qwen3": "apply_liger_kernel_to_qwen3"}
VARIANTS = ("transformers", "cupyrope", "liger")
# regime: (batch, tokens); decode: (sequences, prompt tokens in the cache).
REGIMES = {"prefill": (1, 8192), "train": (1, 4096), "decode": (64, 512), "decode_graph": (64, 512)}
TINY_REGIMES = {"prefill": (1, 64), "train": (1, 32), "decode": (4, 16), "decode_graph": (4, 16)}


# ----------------------------------------------------------------------------------------------- worker


def _config(transformers, family: str, tiny: bool):
    config_name, _, options = FAMILIES[family]
    shape = TINY_SHAPE if tiny else SHAPE
    options = {key: (shape["hidden_size"] // shape["num_attention_heads"] if value is None else value)
               for key, value in options.items()}
    return getattr(transformers, config_name)(**shape, **options, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                              attn_implementation="sdpa")


def _clock(torch, device):
    """A function timing fn() in ms: CUDA events on a GPU (the step's GPU timeline), else the wall clock."""
    if device == "cpu":
        def wall(fn):
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        return wall

    def events(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    return events


def _regime_steps(torch, model, regime: str, batch: int, tokens: int, vocab: int, device):
    """(warm-up and timed) step function of a regime, and what it needs prepared."""
    g = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(3, vocab, (batch, tokens), generator=g).to(device)
    if regime == "prefill":
        model.eval()

        def step():
            with torch.no_grad():
                model(ids, use_cache=False)
        return step
    if regime == "train":
        model.train()

        def step():
            model(ids, labels=ids).loss.backward()
            model.zero_grad(set_to_none=True)
        return step
    if regime == "decode_graph":
        return _graph_decode_step(torch, model, ids, device)
    model.eval()
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    state = {"cache": cache, "next": ids[:, -1:]}

    def step():  # one token a sequence; the cache grows by one
        with torch.no_grad():
            out = model(state["next"], past_key_values=state["cache"], use_cache=True)
        state["cache"], state["next"] = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return step


def _graph_decode_step(torch, model, ids, device):
    """decode_graph's step: one token a sequence on a static cache holding the prompt `ids`, captured in a CUDA graph
    (on a CPU, run eagerly). Every replay writes the cache's last slot and attends over the same cache, so each step
    does the same work (the cache's layers, which count their own length, are rewound to the prompt's inside the
    step); the step's argmax feeds the next step's tokens inside the graph."""
    from transformers import StaticCache

    model.eval()
    prompt = ids.shape[1]
    cache = StaticCache(config=model.config, max_cache_len=prompt + 1)
    with torch.no_grad():
        logits = model(ids, past_key_values=cache, use_cache=True,
                       cache_position=torch.arange(prompt, device=device)).logits
    tokens, position = logits[:, -1:].argmax(-1), torch.tensor([prompt], device=device)

    def decode():
        with torch.no_grad():
            out = model(tokens, past_key_values=cache, use_cache=True, cache_position=position)
            tokens.copy_(out.logits[:, -1:].argmax(-1))
        for layer in getattr(cache, "layers", ()):
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                length.fill_(prompt)
    if device == "cpu":
        return decode
    side = torch.cuda.Stream()  # warm-up off the capturing stream, as torch.cuda.graph asks: every kernel planned
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            decode()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode()

    def replay():
        graph.replay()
    replay.memory = (tokens, position, cache)  # what the graph reads and writes lives as long as the step does
    return replay


def build(family: str, variant: str, device: str, tiny: bool):
    """(model, config, patch report or None) of one variant of one family, in this process; raises ImportError
    where the variant's library is missing."""
    import torch
    import transformers

    if variant == "liger":
        import liger_kernel.transformers as liger

        getattr(liger, LIGER_PATCHES[family])(rope=True, rms_norm=True, swiglu=False, cross_entropy=False,
                                                fused_linear_cross_entropy=False)
    config = _config(transformers, family, tiny)
    torch.manual_seed(0)
    # Initialized where it runs (a CPU initialization of ~1B weights takes seconds) in its dtype, as from_pretrained
    # loads a model: the rotary embedding's inv_freq stays float32 (model.to(torch.bfloat16) would round it, and
    # with it every angle, which the model's own RoPE then differs by from the config's).
    with torch.device(device):
        model = getattr(transformers, FAMILIES[family][1])._from_config(
            config, dtype=torch.float32 if device == "cpu" else torch.bfloat16)
    report = None
    if variant == "cupyrope":
        from .patch import patch_transformers

        report = patch_transformers(model)
    return model, config, report


def regime_step(model, config, regime: str, device: str, tiny: bool):
    """A regime's step function for a built model (the cache of a decode prompt already filled)."""
    import torch

    shapes = TINY_REGIMES if tiny else REGIMES
    return _regime_steps(torch, model, regime, *shapes[regime], config.vocab_size, device)


def gpu_kernel_times(torch, step, steps: int = 3) -> dict:
    """{kernel name: (ms a step, launches a step)} of `steps` calls of step() under the torch profiler: every GPU
    kernel, copy and memset, each by its own GPU time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total, count = kernels.get(event.name, (0.0, 0))
            kernels[event.name] = (total + event.device_time_total / 1e3 / steps, count + 1)
    return {name: (total, count // steps) for name, (total, count) in kernels.items()}


def worker(family: str, variant: str, regimes, steps: int, device: str, tiny: bool) -> dict:
    """Times one variant of one family in this process: {"family", "variant", "ms": {regime: [step times]},
    "busy_ms": {regime: GPU busy ms a step} (on a GPU), "patched": patch report or None} or {"family", "variant",
    "skipped": why}."""
    import torch

    result = {"family": family, "variant": variant}
    try:
        model, config, report = build(family, variant, device, tiny)
    except ImportError as e:
        return {**result, "skipped": f"{e.name or e} is not installed"}
    result["patched"] = None if report is None else {key: len(value) for key, value in report.items()}
    clock = _clock(torch, device)
    result["ms"], result["busy_ms"] = {}, {}
    for regime in regimes:
        step = regime_step(model, config, regime, device, tiny)
        for _ in range(2):
            step()
        result["ms"][regime] = [clock(step) for _ in range(steps)]
        if device != "cpu":
            result["busy_ms"][regime] = sum(ms for ms, _ in gpu_kernel_times(torch, step).values())
    return result


# ----------------------------------------------------------------------------------------------- parent


def run(families, variants, regimes, rounds: int = 2, steps: int = 10, device: str = "cuda", tiny: bool = False,
        timeout: float = 900) -> list:
    """Every (family, variant) in a process of its own, round after round, the variants taking turns. Returns the
    workers' results, each with its "round" (a worker that fails: "skipped" with its error's last line)."""
    results = []
    for r in range(rounds):
        turn = list(variants[r % len(variants):]) + list(variants[:r % len(variants)])
        for family in families:
            for variant in turn:
                spec = dict(family=family, variant=variant, regimes=list(regimes), steps=steps, device=device,
                            tiny=tiny)
                done = subprocess.run([sys.executable, "-m", "cupyrope.model_bench", json.dumps(spec)],
                                      capture_output=True, text=True, timeout=timeout)
                lines = done.stdout.strip().splitlines()
                if done.returncode == 0 and lines:
                    result = json.loads(lines[-1])
                else:
                    error = (done.stderr.strip().splitlines() or ["no output"])[-1]
                    result = {"family": family, "variant": variant, "skipped": f"failed: {error}"}
                results.append({**result, "round": r})
    return results


def summarize(results) -> list:
    """Rows of (family, regime, variant): median step time (ms) over all its steps, the spread of its round medians
    (min, max), its speedup over "transformers" per round (median, min, max) and its median GPU busy time a step
    (None without one); skipped variants with why."""
    rows = []
    timed = [r for r in results if "ms" in r]
    order = {name: i for i, name in enumerate([*FAMILIES, *REGIMES, *VARIANTS])}
    keys = sorted(dict.fromkeys((r["family"], regime, r["variant"]) for r in timed for regime in r["ms"]),
                  key=lambda key: [order.get(name, len(order)) for name in key])
    for family, regime, variant in keys:
        mine = {r["round"]: r["ms"][regime] for r in timed if (r["family"], r["variant"]) == (family, variant)}
        base = {r["round"]: r["ms"][regime] for r in timed if (r["family"], r["variant"]) == (family, "transformers")}
        medians = [statistics.median(steps) for steps in mine.values()]
        speedups = [statistics.median(base[k]) / statistics.median(mine[k]) for k in mine if k in base]
        busy = [r["busy_ms"][regime] for r in timed
                if (r["family"], r["variant"]) == (family, variant) and regime in r.get("busy_ms", {})]
        rows.append(dict(family=family, regime=regime, variant=variant, busy=statistics.median(busy) if busy else None,
                         ms=statistics.median([t for steps in mine.values() for t in steps]),
                         spread=(min(medians), max(medians)),
                         speedup=(statistics.median(speedups), min(speedups), max(speedups)) if speedups else None))
    skipped = {(r["family"], r["variant"]): r["skipped"] for r in results if "skipped" in r}
    rows += [dict(family=family, regime=None, variant=variant, why=why) for (family, variant), why in skipped.items()]
    return rows


def table(rows) -> str:
    lines = ["| model | regime | variant | ms a step (round medians) | speedup over transformers (range) | "
             "GPU busy ms a step |", "|---|---|---|---|---|---|"]
    for row in rows:
        if "why" in row:
            lines.append(f"| {row['family']} | | {row['variant']} | skipped: {row['why']} | | |")
            continue
        low, high = row["spread"]
        speed = "" if row["speedup"] is None else "{:.2f}x ({:.2f}-{:.2f})".format(*row["speedup"])
        busy = "" if row.get("busy") is None else f"{row['busy']:.2f}"
        lines.append(f"| {row['family']} | {row['regime']} | {row['variant']} | {row['ms']:.2f} "
                     f"({low:.2f}-{high:.2f}) | {speed} | {busy} |")
    return "\n".join(lines)


def plot(rows, path: str) -> None:
    """Speedups over transformers per (model, regime), one bar a patched variant, its range as the error bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [r for r in rows if r.get("speedup") and r["variant"] != "transformers"]
    groups = list(dict.fromkeys((r["family"], r["regime"]) for r in bars))
    variants = list(dict.fromkeys(r["variant"] for r in bars))
    fig, ax = plt.subplots(figsize=(1.6 * len(groups) + 2, 4))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        for j, group in enumerate(groups):
            row = next((r for r in bars if (r["family"], r["regime"]) == group and r["variant"] == variant), None)
            if row:
                mid, low, high = row["speedup"]
                ax.bar(j + i * width, mid, width, yerr=[[mid - low], [high - mid]], capsize=3,
                       label=variant if j == 0 else None, color=f"C{i}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks([j + width * (len(variants) - 1) / 2 for j in range(len(groups))],
                  [f"{family}\n{regime}" for family, regime in groups])
    ax.set_ylabel("speedup over transformers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def selection(args) -> tuple:
    """(families, variants, regimes) a ``bench --op model`` run times: args.family's and args.regime's (repeatable
    options; default every one), every variant."""
    return (getattr(args, "family", None) or list(FAMILIES), VARIANTS, getattr(args, "regime", None) or list(REGIMES))


def main(args) -> int:
    """``bench --op model``: args.family's families and args.regime's regimes (default: all), the three variants,
    args.rounds rounds (at least 2)."""
    import torch

    if not torch.cuda.is_available():
        print("cupyrope bench --op model: needs torch with CUDA", file=sys.stderr)
        return 1
    try:
        import transformers
    except ImportError:
        print("cupyrope bench --op model: needs transformers (pip install transformers)", file=sys.stderr)
        return 1
    print(f"{time.strftime('%Y-%m-%d')}, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}; each variant in a process of its own")
    results = run(*selection(args), rounds=max(2, args.rounds))
    rows = summarize(results)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "rows": rows}, f, indent=1)
    if args.plot:
        try:
            plot(rows, args.plot)
            print(f"plot: {args.plot}")
        except ImportError:
            print("plot: needs matplotlib (pip install \"cupyrope[bench]\")", file=sys.stderr)
    return 0


if __name__ == "__main__":  # a worker: python -m cupyrope.model_bench '<spec JSON>'
    spec = json.loads(sys.argv[1])
    print(json.dumps(worker(spec["family"], spec["variant"], spec["regimes"], spec["steps"], spec["device"],
                            spec["tiny"])))
