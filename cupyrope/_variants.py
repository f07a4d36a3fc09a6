"""Every kernel variant the launchers can ask for (the compile-only path builds them all)."""

# Imported by name: the package re-exports the functions `rope` etc. over the module attributes.
from .rmsnorm import all_variants as rmsnorm_variants
from .rope import all_variants as rope_variants


def all_variants() -> list[tuple[str, str]]:
    return [*rope_variants(), *rmsnorm_variants()]
