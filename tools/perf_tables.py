"""The tables of docs/performance.md, from the JSON files of benchmark runs (no GPU needed).

Usage: python tools/perf_tables.py RUN.json [RUN.json ...]
(written by `python -m cupyrope bench [--full] [--op rope|rmsnorm|layer_norm|qk_norm_rope] --json ...`; a file may
hold any of the ops). Prints markdown: the RoPE cases, the RMSNorm headline shapes, the LayerNorm cases, the
[4, S, H] grids where the run has them (bold: the fastest), the QK-norm + RoPE cases, and every case where a peer is
faster than cupyrope's fastest provider in GPU time.
"""

import collections
import json
import sys

ROPE_CASES = ["Llama q 32768x32x128", "Llama-3-8B q+k T=32768", "65536x32x128", "seed 8192x32x256",
              "decode 1x32x128", "Llama-3-8B q+k T=1", "Llama-3-8B q+k T=16"]
RMS_SHAPES = ["32768x4096", "8192x16384", "8192x1027", "16384x8192", "1x4096"]
GRID_H = [32, 61, 64, 128, 130, 256, 512, 1024, 1027, 2048, 4096, 8192, 16384]
GRID_S = [128, 512, 2048]
RMS_PROVIDERS = ("cupyrope", "cupyrope (no PDL)", "liger", "F.rms_norm")
LN_PROVIDERS = ("cupyrope", "cupyrope (no PDL)", "liger", "F.layer_norm", "torch.compile")


def load(path):
    data = json.load(open(path))
    cases = collections.OrderedDict()
    for r in data["results"]:
        cases.setdefault((r["op"], r["label"]), {})[r["provider"]] = r
    return data, cases


def us(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}"


def percent(r, copy_gbps) -> str:
    share = 100 * r["gbps"] / copy_gbps
    return f"{share:.0f}%" if share >= 1 else ""  # blank for calls that are a launch and a latency chain


def rope_table(data, cases):
    print("| case, dtype | provider | GPU µs | eager µs | % of copy BW |")
    print("|---|---|---|---|---|")
    for label in ROPE_CASES:
        providers = cases.get(("rope", label))
        if providers is None:
            continue
        first = True
        for name, r in sorted(providers.items(), key=lambda item: item[1]["gpu_us"]):
            if name.startswith("torch eager"):
                continue
            case = f"{label} {r['dtype']}" if first else ""
            print(f"| {case} | {name} | {us(r['gpu_us'])} | {us(r['eager_us'])} | {percent(r, data['copy_gbps'])} |")
            first = False


def rms_table(data, cases):
    print("| shape, dtype | cupyrope GPU / eager µs | no PDL GPU / eager µs | Liger GPU / eager µs | F.rms_norm GPU / eager µs "
          "| cupyrope % of copy BW |")
    print("|---|---|---|---|---|---|")
    for op, direction in (("rms_fwd", "fwd"), ("rms_bwd", "bwd")):
        for label in RMS_SHAPES:
            providers = cases.get((op, label))
            if providers is None:
                continue
            cells = [f"{us(providers[p]['gpu_us'])} / {us(providers[p]['eager_us'])}" if p in providers else "-"
                     for p in RMS_PROVIDERS]
            dtype = providers["cupyrope"]["dtype"]
            print(f"| {direction} [{label.replace('x', ', ')}] {dtype} | " + " | ".join(cells)
                  + f" | {percent(providers['cupyrope'], data['copy_gbps'])} |")


def gpu_cells(providers, shown) -> dict:
    """GPU µs per call of the providers in `shown` that ran, the fastest in bold."""
    times = {p: providers[p]["gpu_us"] for p in shown if p in providers}
    best = min(times, key=times.get)
    return {p: f"**{us(t)}**" if p == best else us(t) for p, t in times.items()}


def grid(cases, op, providers_shown=RMS_PROVIDERS):
    if (op, f"[4,{GRID_S[0]},{GRID_H[0]}]") not in cases:
        return
    names = " / ".join(p.replace("cupyrope (no PDL)", "cupyrope without PDL") for p in providers_shown)
    print(f"{op}, [4, S, H] bf16, GPU µs per call: {names} (bold: fastest)\n")
    print("| H | " + " | ".join(f"S={s}" for s in GRID_S) + " |")
    print("|---|" + "---|" * len(GRID_S))
    for h in GRID_H:
        cells = []
        for s in GRID_S:
            cells.append(" / ".join(gpu_cells(cases[(op, f"[4,{s},{h}]")], providers_shown).values()))
        print(f"| {h} | " + " | ".join(cells) + " |")
    print()


def ln_table(data, cases):
    """The LayerNorm headline cases: GPU µs per call of each provider (bold: fastest), cupyrope's share of copy
    bandwidth."""
    print("| op | rows × hidden, dtype | " + " | ".join(LN_PROVIDERS) + " | cupyrope % of copy BW |")
    print("|---|---|" + "---|" * (len(LN_PROVIDERS) + 1))
    for (op, label), providers in cases.items():
        if op not in ("ln_fwd", "ln_bwd") or label.startswith("["):
            continue
        marked = gpu_cells(providers, LN_PROVIDERS)
        cells = [marked.get(p, "") for p in LN_PROVIDERS]
        print(f"| {op} | {label.replace('x', ' × ')} {providers['cupyrope']['dtype']} | " + " | ".join(cells)
              + f" | {percent(providers['cupyrope'], data['copy_gbps'])} |")


QK_OPS = ("qk_norm_rope", "qk_norm_rope_bwd", "rope_qk_positions")


def qk_table(data, cases):
    """Every QK-norm + RoPE and position-source case, each provider on a row."""
    print("| op | case | provider | GPU µs | eager µs | % of copy BW |")
    print("|---|---|---|---|---|---|")
    for (op, label), providers in cases.items():
        if op not in QK_OPS:
            continue
        for i, (name, r) in enumerate(providers.items()):
            first = f"{op} | {label}" if i == 0 else " | "
            print(f"| {first} | {name} | {us(r['gpu_us'])} | {us(r['eager_us'])} | {percent(r, data['copy_gbps'])} |")


def peers_ahead(cases, plain=False):
    """Cases where a peer's GPU time beats cupyrope's fastest provider (the drop-in counts as cupyrope's); plain:
    cupyrope's providers that launch plainly (no PDL) only, where the benchmark has them."""
    for (op, label), providers in cases.items():
        mine = [(r["gpu_us"], p) for p, r in providers.items() if p.startswith("cupyrope")]
        if plain:
            mine = [(t, p) for t, p in mine if p.endswith("(no PDL)")]
            if not mine:
                continue
        ours = min(mine)
        peers = [(r["gpu_us"], p) for p, r in providers.items() if not p.startswith("cupyrope")]
        if peers and min(peers) < ours:
            theirs = min(peers)
            print(f"- {op} {label}: {theirs[1]} {theirs[0]:.3f} µs against {ours[1]} {ours[0]:.3f}")


def main(paths):
    for path in paths:
        data, cases = load(path)
        print(f"{path}: {data['environment']}\n")
        if any(op == "rope" for op, _ in cases):
            rope_table(data, cases)
            print()
        if any(op.startswith("rms") for op, _ in cases):
            rms_table(data, cases)
            print()
            grid(cases, "rms_fwd")
            grid(cases, "rms_bwd")
        if any(op.startswith("ln_") for op, _ in cases):
            ln_table(data, cases)
            print()
            grid(cases, "ln_fwd", LN_PROVIDERS)
            grid(cases, "ln_bwd", LN_PROVIDERS)
        if any(op in QK_OPS for op, _ in cases):
            qk_table(data, cases)
            print()
        print("Peers ahead in GPU time:")
        peers_ahead(cases)
        print("\nPeers ahead of cupyrope launched plainly (no PDL):")
        peers_ahead(cases, plain=True)
        print()


if __name__ == "__main__":
    main(sys.argv[1:])
