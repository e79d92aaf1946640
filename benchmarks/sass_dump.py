"""SASS of one kernel variant built as the runtime builds it, with extra -D
options per build (device only: NVRTC of the device's CUDA, then cuobjdump).

    PYTHONPATH=. python benchmarks/sass_dump.py --family gemm_latency \
        --args 4 float16 uint8 1 --define KBIT_X=0 --define KBIT_X=1 --out DIR

Writes DIR/<family>_<n>.sass per build (n: the build's index, 0 the default
build) and prints each build's registers and SASS instruction count.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", default="gemm_latency")
    p.add_argument("--args", nargs="+", required=True, help="template arguments, as in _jit.Variant")
    p.add_argument("--define", action="append", default=[], help="NAME=VALUE: one build each")
    p.add_argument("--arch", default="sm_90a")
    p.add_argument("--out", default=".")
    a = p.parse_args()

    from cupy_backends.cuda.libs import nvrtc

    from kbit_cupy import _jit

    want = tuple(int(x) if x.lstrip("-").isdigit() else x for x in a.args)
    want = tuple(True if x == "True" else x for x in want)
    v = next(v for v in _jit.all_variants() if v.family == a.family and v.args == want)
    src = _jit.render_source(a.family)
    os.makedirs(a.out, exist_ok=True)
    for n, define in enumerate([None, *a.define]):
        prog = nvrtc.createProgram(src, "k.cu", [], [])
        nvrtc.addNameExpression(prog, v.name)
        opts = [*_jit.compile_options(), "-ftz=true", f"-arch={a.arch}", "--ptxas-options=-v"]
        if define:
            opts.append(f"-D{define}")
        nvrtc.compileProgram(prog, opts)
        log = nvrtc.getProgramLog(prog)
        cubin = nvrtc.getCUBIN(prog)
        cubin = bytes(cubin) + b"\0"  # CuPy's getCUBIN drops the last byte (sass_mix.py)
        with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
            f.write(cubin)
        run = subprocess.run(["cuobjdump", "-sass", f.name], capture_output=True, text=True, check=False)
        sass = run.stdout
        if "/*" not in sass:  # cuobjdump could not read it: the disassembler itself
            run = subprocess.run(["nvdisasm", "-c", f.name], capture_output=True, text=True, check=False)
            sass = run.stdout or run.stderr
        os.unlink(f.name)
        path = os.path.join(a.out, f"{a.family}_{n}.sass")
        with open(path, "w") as f:
            f.write(f"// build {n}: {define or 'default'}\n{sass}")
        regs = [line.strip() for line in str(log).splitlines() if "registers" in line]
        count = sum(1 for line in sass.splitlines() if ";" in line and "/*" in line)
        print(f"build {n} ({define or 'default'}): {regs[-1] if regs else '?'}; {count} instructions")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
