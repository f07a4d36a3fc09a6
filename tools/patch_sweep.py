"""patch_transformers over every causal-LM family the installed transformers ships, on the CPU (no GPU needed).

Each family is built at a tiny size from its default config (2 layers, hidden 64, 4 heads of 16, its RMSNorm weights
random), twice from one seed; one copy is patched. The patch must leave the model computing what it did: the same
logits (fp32 roundings), the same greedy tokens with the KV cache, and every parameter's gradient of a training step
(dropout off, one seed for both). Each family runs in a process of its own, with a time and memory limit. A family
whose tiny config does not build is listed as such, not as a failure. Exit status 1 where a patched model differs or
patch_transformers raises. Run it after a transformers upgrade and before changing cupyrope/patch.py:
PYTHONPATH=. python tools/patch_sweep.py [--family NAME ...] [--seconds 240]
"""

import argparse
import collections
import resource
import subprocess
import sys
import warnings

TINY = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, head_dim=16, pad_token_id=0)
MEMORY_BYTES = 6 << 30  # a family's process; some default configs build large embeddings or experts


def families() -> list:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _tiny_model(family: str):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    for key, value in TINY.items():
        try:
            setattr(text, key, value)
        except Exception:  # a read-only or per-layer attribute: the family's default stays
            pass
    if getattr(text, "layer_types", None) is not None:
        text.layer_types = list(text.layer_types)[: TINY["num_hidden_layers"]]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norms start at their identity: make them count
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.Tensor):
                weight.copy_(torch.randn(weight.shape, generator=g))
    return model


def _outputs(model, ids):
    """(logits, greedy tokens, {parameter: gradient}) of the model."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=ids)[0]
        tokens = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        for key, value in list(vars(module).items()):
            if "dropout" in key and isinstance(value, float):
                setattr(module, key, 0.0)
    torch.manual_seed(5)  # routers' jitter draws the same numbers in both models
    model(input_ids=ids, labels=ids).loss.backward()
    return logits, tokens, {name: p.grad for name, p in model.named_parameters()}


def check_family(family: str) -> str:
    """One line: the family, what the patch did, and whether the patched model computes what the model did."""
    import torch

    from cupyrope import patch

    ids = torch.randint(1, TINY["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(2))
    try:
        plain = _tiny_model(family)
        expected = _outputs(plain, ids)
        patched = _tiny_model(family)
    except Exception as error:
        return f"{family:28s} not built at tiny size ({type(error).__name__})"
    source = sys.modules[type(patched).__module__]
    original_rope = getattr(source, "apply_rotary_pos_emb", None)
    try:
        report = patch.patch_transformers(patched)
        got = _outputs(patched, ids)
    except Exception as error:
        return f"{family:28s} PATCH FAILS {type(error).__name__}: {error}"
    finally:
        if original_rope is not None:  # the process ends anyway; a caller importing this keeps its functions
            source.apply_rotary_pos_emb = original_rope
    counts = " ".join(f"{key}={len(value)}" for key, value in report.items() if key != "skipped")
    problems = []
    scale = float(expected[0].abs().max()) or 1.0
    if not torch.allclose(got[0], expected[0], rtol=1e-4, atol=1e-5 * scale):
        problems.append("logits")
    if not torch.equal(got[1], expected[1]):
        problems.append("greedy tokens")
    # A gradient is compared at its own scale, or at a ten-thousandth of the model's largest where it is smaller than
    # that: a router's gradient that is all cancellation (1e-10 where others are 1e-2) differs in its rounding alone.
    largest = max((float(g.abs().max()) for g in expected[2].values() if g is not None), default=1.0)
    for name, grad in expected[2].items():
        other = got[2][name]
        if (grad is None) != (other is None):
            problems.append(f"{name}'s gradient (present in one model only)")
        elif grad is not None:
            scale = max(float(grad.abs().max()), 1e-4 * largest)
            if not torch.allclose(other, grad, rtol=1e-3, atol=1e-4 * scale):
                problems.append(f"{name}'s gradient")
    status = f"DIFFERS in {', '.join(problems[:3])}" if problems else "same"
    return f"{family:28s} {status:9s} {counts} skipped={len(report['skipped'])}"


def _limit_memory():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_BYTES, MEMORY_BYTES))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", help="a model type (e.g. llama); repeatable; default: all")
    parser.add_argument("--seconds", type=int, default=240, help="time limit of one family's process")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: check one family
    args = parser.parse_args()
    if args.one:
        warnings.filterwarnings("ignore")
        print(check_family(args.one), flush=True)
        return 0
    tally = collections.Counter()
    for family in args.family or families():
        try:
            run = subprocess.run([sys.executable, __file__, "--one", family], capture_output=True, text=True,
                                 timeout=args.seconds, preexec_fn=_limit_memory)
            lines = [line for line in run.stdout.splitlines() if line.startswith(family + " ")]
            line = lines[-1] if lines else f"{family:28s} not built at tiny size (its process ended: {run.returncode})"
        except subprocess.TimeoutExpired:
            line = f"{family:28s} not built at tiny size (over {args.seconds} s)"
        print(line, flush=True)
        tally["differs" if " DIFFERS " in line else "patch fails" if " PATCH FAILS " in line else
              "not built" if " not built " in line else "same"] += 1
    print(", ".join(f"{count} {status}" for status, count in tally.most_common()))
    return 1 if tally["differs"] or tally["patch fails"] else 0


if __name__ == "__main__":
    sys.exit(main())
