"""The ops, each in a few files named after it: <op>.py (public functions and their call paths),
<op>_checks.py (argument checks), <op>_plan*.py (pure planning: kernel variant, grid, block, parameters)."""


def all_variants() -> list[tuple[str, str]]:
    """Every (kernel source, kernel variant) a planner can ask for: what `python -m cupyrope compile` builds."""
    from . import (layernorm_plan, qk_norm_rope_plan, rmsnorm_plan_backward, rmsnorm_plan_forward, rmsnorm_plan_fp8,
                   rope_plan)

    return [*rope_plan.variants(), *rmsnorm_plan_forward.variants(), *rmsnorm_plan_backward.variants(),
            *rmsnorm_plan_fp8.variants(), *qk_norm_rope_plan.variants(), *layernorm_plan.variants()]
