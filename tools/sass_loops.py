"""A kernel variant's loops in SASS, with no GPU: each loop's length and its instructions by opcode, to see where a
row's instructions go (address arithmetic, shared-memory traffic, selects, spills).

NVRTC's cubins are not readable by cuobjdump or nvdisasm (see sass_digest.py), so this assembles NVRTC's PTX with
the ptxas on PATH (a CUDA toolkit) and disassembles that with cuobjdump and nvdisasm (on PATH, or from their
wheels: `pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`). The PTX's ISA version line is lowered to what
that ptxas reads, so the SASS is that ptxas's: close to what the GPU runs, not byte for byte. Compare variants or
source changes in one run of this tool, and confirm on a GPU.

Usage: python tools/sass_loops.py "cupyrope::qk_norm_rope_bwd_kernel<__nv_bfloat16, ...>" [--arch sm_90] [--sass F]
(the name as cupyrope.ops.all_variants() spells it; `python tools/sass_loops.py --list qk_norm_rope_bwd` lists
those containing a string).
"""

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

from cupyrope._runtime import compile as _compile
from cupyrope.ops import all_variants

INSTRUCTION = re.compile(r"\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z0-9_]+)(.*?)\s*;")


def _tools_path() -> str:
    """PATH with the CUDA binary tools' wheels (cuobjdump runs nvdisasm) ahead of it."""
    wheels = Path(sysconfig.get_paths()["purelib"]) / "nvidia" / "cu13" / "bin"
    path = os.pathsep.join([str(wheels), os.environ.get("PATH", "")])
    if not (shutil.which("cuobjdump", path=path) and shutil.which("nvdisasm", path=path)):
        sys.exit("cuobjdump and nvdisasm not found: put a CUDA toolkit's bin on PATH or "
                 "`pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm`")
    return path


def sass_of(name: str, arch: str) -> str:
    sources = [source for source, variant in all_variants() if variant == name]
    if not sources:
        sys.exit(f"no kernel variant is named {name!r}")
    if not shutil.which("ptxas"):
        sys.exit("ptxas not found: put a CUDA toolkit's bin on PATH")
    ptx = _compile._nvrtc_compile(sources[0], name, "compute_" + arch.removeprefix("sm_"))[0].rstrip(b"\0").decode()
    with tempfile.TemporaryDirectory() as tmp:
        assemble = ["ptxas", f"-arch={arch}", "-O3", "k.ptx", "-o", "k.cubin"]
        (Path(tmp) / "k.ptx").write_text(ptx)
        done = subprocess.run(assemble, cwd=tmp, capture_output=True, text=True)
        newest = re.search(r"current version is '(\d+\.\d+)'", done.stderr)
        if done.returncode and newest:  # a newer PTX ISA than this ptxas reads: say its own
            (Path(tmp) / "k.ptx").write_text(re.sub(r"^\.version \S+", f".version {newest.group(1)}", ptx,
                                                    count=1, flags=re.M))
            done = subprocess.run(assemble, cwd=tmp, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"ptxas failed: {done.stderr}")
        path = _tools_path()
        return subprocess.run([shutil.which("cuobjdump", path=path), "-sass", "k.cubin"], cwd=tmp, check=True,
                              capture_output=True, text=True, env=dict(os.environ, PATH=path)).stdout


def loops(sass: str):
    """(start, end, Counter of opcodes) of each backward branch's span, innermost first."""
    code = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    spans = []
    for address, opcode, operands in code:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode == "BRA" else None
        if target and int(target.group(1), 16) < address:
            start = int(target.group(1), 16)
            spans.append((start, address, collections.Counter(op for a, op, _ in code if start <= a <= address)))
    return sorted(spans, key=lambda span: span[1] - span[0]), len(code)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("name", nargs="?")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--sass", help="also write the whole SASS here")
    parser.add_argument("--list", metavar="SUBSTRING", help="list the variants whose names contain it")
    args = parser.parse_args()
    if args.list is not None or not args.name:
        print("\n".join(name for _, name in all_variants() if (args.list or "") in name))
        return
    sass = sass_of(args.name, args.arch)
    if args.sass:
        Path(args.sass).write_text(sass)
    spans, total = loops(sass)
    print(f"{args.name}: {total} instructions ({args.arch}, local ptxas)")
    for start, end, opcodes in spans:
        common = ", ".join(f"{op} {n}" for op, n in opcodes.most_common(12))
        print(f"  loop 0x{start:x}-0x{end:x}: {sum(opcodes.values())} instructions: {common}")


if __name__ == "__main__":
    main()
