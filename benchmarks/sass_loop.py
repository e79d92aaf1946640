"""SASS instruction mix of a gemm_mma variant's main loop (needs cuobjdump).

usage: python benchmarks/sass_loop.py 4:float16:uint8:32:1:2 [...] [--arch sm_90a]
       [--define KBIT_CB_FOLD=1 ...]   (each variant also built with -DNAME=VALUE)
The loop is the innermost backward branch whose body holds every HGMMA (or
HMMA) of the K-tile loop; its opcode counts are per K tile when the body is
one tile (slab staging: one set of index words, so the loop is not unrolled
by two), or per two tiles otherwise (printed: tiles per body). A K tile is
16 rows x 256 columns per warp and row tile: 128 weights per lane, so
instructions per weight per lane = count / (128 x row tiles a warp x tiles).
"""

import argparse
import collections
import re

from sass_mix import parse_variant, sass_of

LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)([^;]*);")


def loop_mix(sass: str):
    ins = [(int(m.group(1), 16), m.group(3), m.group(4)) for m in LINE.finditer(sass)]
    mma = [a for a, op, _ in ins if op.startswith(("HGMMA", "HMMA"))]
    best = None
    for addr, op, rest in ins:
        if op.startswith("BRA") and (t := re.search(r"0x([0-9a-f]+)", rest)):
            target = int(t.group(1), 16)
            if target < addr:
                inside = [a for a in mma if target <= a <= addr]
                if inside and (best is None or len(inside) > best[2]
                               or (len(inside) == best[2] and addr - target < best[1] - best[0])):
                    best = (target, addr, len(inside))
    lo, hi, _ = best
    return collections.Counter(op.split(".")[0] for a, op, _ in ins if lo <= a <= hi)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="+", help="k:dtype:scale:m_tiles:rpw:wg")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="also build each variant with -DNAME=VALUE (repeatable: one build each)")
    args = parser.parse_args()
    for text in args.variants:
        family, targs = parse_variant("gemm_mma:" + text)
        for define in [None, *args.define]:
            ops = loop_mix(sass_of(family, targs, args.arch, (f"-D{define}",) if define else ()))
            n_mma = ops.get("HGMMA", 0) or ops.get("HMMA", 0)
            steps = 16 if ops.get("HGMMA") else 16 * targs[3] * targs[4]  # per K tile
            tiles = n_mma / steps
            total = sum(ops.values())
            rpw = 1 if ops.get("HGMMA") else targs[4]  # row tiles a warp: 128 weights a lane each
            print(f"== gemm_mma<{text}>{f' -D{define}' if define else ''} main loop: {total} "
                  f"instructions, {tiles:g} K tile(s) of {rpw} row tile(s): "
                  f"{total / (128 * rpw * tiles):.2f} per weight per lane")
            print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(24)))


if __name__ == "__main__":
    main()
