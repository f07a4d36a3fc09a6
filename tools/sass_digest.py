"""A digest of every kernel variant's SASS (NVRTC, no GPU), to check that a source change leaves the
kernels it does not mean to touch unchanged: the bytes of each cubin's code sections (the same bytes: the same
SASS), its registers and stack frame. Needs pyelftools (`pip install pyelftools`; cuobjdump 13.5 and nvdisasm read
none of NVRTC 13.5's cubins).

Usage: python tools/sass_digest.py [--arch sm_90] [--match SUBSTRING] OUT.json
       python tools/sass_digest.py --compare OLD.json NEW.json
Run it once in the old tree (e.g. `git worktree add /tmp/old HEAD~1`, then from there) and once in the new one,
then compare: variants whose instructions differ are listed with their registers and spill bytes before and after.
Variants are matched by name, so kernels that moved between source files compare too.
"""

import argparse
import hashlib
import io
import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from elftools.elf.elffile import ELFFile

from cupyrope._runtime import compile as _compile
from cupyrope.ops import all_variants


def _info(cubin) -> dict:
    """Attribute code -> value of the cubin's .nv.info entries with a (symbol, value) payload: 0x2f registers,
    0x11 the stack frame in bytes (spills)."""
    data, values, i = cubin.get_section_by_name(".nv.info").data(), {}, 0
    while i < len(data):
        form, attribute = data[i], data[i + 1]
        if form == 4:  # size-prefixed payload
            size = struct.unpack_from("<H", data, i + 2)[0]
            if size == 8:
                values[attribute] = struct.unpack_from("<I", data, i + 8)[0]
            i += 4 + size
        else:
            i += 4
    return values


def digest(arch: str, source: str, name: str) -> dict:
    binary, _ = _compile._nvrtc_compile(source, name, arch)
    cubin = ELFFile(io.BytesIO(binary))
    code = b"".join(s.data() for s in cubin.iter_sections() if s.name.startswith(".text."))
    info = _info(cubin)
    return {"sha": hashlib.sha256(code).hexdigest()[:16], "instructions": len(code) // 16,
            "registers": info.get(0x2F), "stack": info.get(0x11)}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out", nargs="?")
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--match", default="")
    parser.add_argument("--compare", nargs=2)
    args = parser.parse_args()
    if args.compare:
        old, new = (json.loads(Path(p).read_text()) for p in args.compare)
        same = [n for n in new if n in old and old[n]["sha"] == new[n]["sha"]]
        changed = [n for n in new if n in old and old[n]["sha"] != new[n]["sha"]]
        print(f"{len(same)} unchanged, {len(changed)} changed, {len(set(new) - set(old))} new, "
              f"{len(set(old) - set(new))} gone")
        for n in changed:
            o, w = old[n], new[n]
            print(f"  {n}: {o['instructions']} -> {w['instructions']} instructions, registers {o['registers']} -> "
                  f"{w['registers']}, stack {o['stack']} -> {w['stack']}")
        for n in sorted(set(new) - set(old)):
            print(f"  new {n}: {new[n]['instructions']} instructions, {new[n]['registers']} registers, "
                  f"stack {new[n]['stack']}")
        return
    variants = [(s, n) for s, n in all_variants() if args.match in n]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        results = pool.map(lambda v: digest(args.arch, *v), variants)
        table = {n: r for (_, n), r in zip(variants, results)}
    Path(args.out).write_text(json.dumps(table, indent=1))
    print(f"{len(table)} variants for {args.arch} -> {args.out}")


if __name__ == "__main__":
    main()
