"""SASS instruction mix of kernel variants (needs cuobjdump; runs where a CUDA toolkit is).

usage: python benchmarks/sass_mix.py quantize:4:float16:uint8:false dequantize:5:float16:uint8
       [--define KBIT_X=0 ...] [--dump DIR]
Compiles each variant with the package's NVRTC options for --arch (default
sm_90a), disassembles it and prints the opcode histogram; with --define, also
one build per -DNAME=VALUE (its SASS in DIR as <variant>_<define>.sass).
"""

import argparse
import collections
import re
import subprocess
import tempfile
from pathlib import Path

from cupy_backends.cuda.libs import nvrtc

from kbit_cupy import _jit


def parse_variant(text: str):
    family, *args = text.split(":")
    out = []
    for a in args:
        out.append(int(a) if a.isdigit() else {"true": True, "false": False}.get(a, a))
    return family, tuple(out)


def sass_of(family: str, args: tuple, arch: str, extra: tuple = ()) -> str:
    name = _jit.kernel_name(family, *args)
    prog = nvrtc.createProgram(_jit.render_source(family), "k.cu", [], [])
    nvrtc.addNameExpression(prog, name)
    nvrtc.compileProgram(prog, [*_jit.compile_options(), "-ftz=true", f"-arch={arch}", *extra])
    cubin = nvrtc.getCUBIN(prog) + b"\0"  # CuPy's getCUBIN drops the last byte
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("variants", nargs="+")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--dump", default=None, help="directory to write each variant's full SASS")
    parser.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                        help="also a build with -DNAME=VALUE (one build each; A/B of a kernel knob)")
    args = parser.parse_args()
    op = re.compile(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
    for text in args.variants:
        family, targs = parse_variant(text)
        for define in [None, *args.define]:
            extra = (f"-D{define}",) if define else ()
            sass = sass_of(family, targs, args.arch, extra)
            if args.dump:
                Path(args.dump).mkdir(parents=True, exist_ok=True)
                stem = text.replace(":", "_") + (f"_{define.replace('=', '_')}" if define else "")
                (Path(args.dump) / (stem + ".sass")).write_text(sass)
            ops = collections.Counter(m.group(1).split(".")[0] for m in op.finditer(sass))
            total = sum(ops.values())
            label = f", -D{define}" if define else ""
            print(f"== {_jit.kernel_name(family, *targs)} ({args.arch}{label}): {total} instructions")
            print("   " + ", ".join(f"{k} {v}" for k, v in ops.most_common(40)))


if __name__ == "__main__":
    main()
