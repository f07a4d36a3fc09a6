"""The parameter structs the launcher packs on the host mirror the kernels' structs, field for field
(a mismatch would shift every field after it: silent garbage). Reads the .cu text; no GPU, no CuPy."""

import importlib
import re

import pytest

from cupyrope._runtime.compile import kernels_dir


def _struct_format(source: str, name: str) -> str:
    """struct.Struct codes of a kernel parameter struct's fields, read from its source text: pointers
    'Q', i64 'q', double 'd', float 'f' (arrays repeat their code)."""
    text = (kernels_dir() / source).read_text()
    body = re.search(r"struct " + name + r" \{(.*?)\n\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    # An anonymous union of same-sized scalar members (two names for one field) counts as its first.
    body = re.sub(r"union \{(.*?)\};", lambda m: _one_union_member(m.group(1)), body, flags=re.S)
    return "".join(_declaration_codes(d) for d in filter(None, (d.strip() for d in body.split(";"))))


def _declaration_codes(declaration: str) -> str:
    kind, names = re.match(r"((?:const )?\w+\*?)\s+(.*)", declaration, re.S).groups()
    code = "Q" if kind.endswith("*") else {"i64": "q", "double": "d", "float": "f"}[kind]
    codes = ""
    for field in names.split(","):
        count = re.search(r"\[(\d+)\]", field)
        codes += code * (int(count.group(1)) if count else 1)
    return codes


def _one_union_member(members: str) -> str:
    declarations = [d.strip() for d in members.split(";") if d.strip()]
    codes = {_declaration_codes(d) for d in declarations}
    assert len(codes) == 1 and len(codes.pop()) == 1, f"union members of different sizes: {declarations}"
    return declarations[0] + ";"


def _expand(fmt: str) -> str:
    return "".join(code * int(n or 1) for n, code in re.findall(r"(\d*)([a-zA-Z])", fmt.lstrip("<")))


@pytest.mark.parametrize("source,name,pointers,tail", [
    ("rope_common.cuh", "RopeParams", 12, "cupyrope.ops.rope_plan:_TAIL"),
    ("rmsnorm_fwd.cu", "NormParams", 6, "cupyrope.ops.rmsnorm:FWD_TAIL"),
    ("rmsnorm_bwd.cu", "NormBwdParams", 7, "cupyrope.ops.rmsnorm:BWD_TAIL"),
    ("rmsnorm_bwd.cu", "DweightParams", 2, "cupyrope.ops.rmsnorm:DW_TAIL"),
    ("rmsnorm_fp8.cu", "Fp8NormParams", 7, "cupyrope.ops.rmsnorm_fp8:FP8_TAIL"),
])
def test_parameter_structs_mirror_the_kernels(source, name, pointers, tail):
    """The launcher packs pointers then the planner's tail: field for field what the kernel's struct holds."""
    module, attribute = tail.split(":")
    packed = getattr(importlib.import_module(module), attribute)
    assert _struct_format(source, name) == "Q" * pointers + _expand(packed.format)


@pytest.mark.parametrize("source,name,pointers,base,runs", [
    ("rmsnorm_fwd.cu", "NormRunsParams : NormParams", 6, "FWD_TAIL", "FWD_RUNS_TAIL"),
    ("rmsnorm_bwd.cu", "NormBwdRunsParams : NormBwdParams", 7, "BWD_TAIL", "BWD_RUNS_TAIL"),
])
def test_runs_structs_extend_their_ops(source, name, pointers, base, runs):
    """The rms_norm_*_runs kernels' structs: their own fields after their op's struct, from its size rounded up to 8
    bytes (the padding the tail skips)."""
    module = importlib.import_module("cupyrope.ops.rmsnorm")
    base_bytes = 8 * pointers + getattr(module, base).size
    assert _expand(getattr(module, runs).format) == "x" * (-base_bytes % 8) + _struct_format(source, name)
