"""Print what NVRTC reports for one offline-compiled variant (the compile
check's program, options and name expression): ok, the lowered name, the
ptxas lines, and the parse the check makes of them. For a variant the check
fails with "no ptxas report" on one machine and not on another.

    python benchmarks/compile_diag.py gemm_mma 4 float16 uint8 2 1 1 True [--arch sm_90a]
"""
import argparse
import ast

from kbit_cupy import _jit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family")
    p.add_argument("args", nargs="+", help="template arguments (Python literals or names)")
    p.add_argument("--arch", default="sm_90a")
    o = p.parse_args()
    args = []
    for a in o.args:
        try:
            args.append(ast.literal_eval(a))
        except (ValueError, SyntaxError):
            args.append(a)
    v = _jit.Variant(o.family, tuple(args))
    print("variant", v.name)
    try:
        from cupy_backends.cuda.libs import nvrtc
        print("nvrtc", nvrtc.getVersion())
    except Exception as e:  # noqa: BLE001 - a diagnostic
        print("nvrtc version unknown:", e)
    seen = []
    compile_once = _jit._nvrtc_compile

    def recording(*a):
        out = compile_once(*a)
        seen.append((a[2], out))
        return out

    _jit._nvrtc_compile = recording
    # the check first (as a test in a fresh process), then the same program twice directly
    (res,) = _jit.compile_check([o.arch], [v])
    print("compile_check", res.ok, res.registers, res.spill_bytes, res.smem_bytes, res.log[:300])
    options = [*_jit.compile_options(), "-ftz=true", "--ptxas-options=-v", f"-arch={o.arch}"]
    for _ in range(2):
        recording(_jit.render_source(o.family), [v.name], options)
    for opts, (ok, log, lowered) in seen:
        print("-- options", opts)
        print("ok", ok, "lowered", lowered, "log chars", len(log))
        for line in log.splitlines():
            if "ptxas" in line or "Compiling entry" in line or "Used" in line or "spill" in line:
                print("  ", line[:240])
        print("parsed", {n[:60]: st for n, st in _jit._parse_ptxas(log).items()})


if __name__ == "__main__":
    main()
