"""Whether a kernel family's variants compile to the same PTX as at another
commit (no GPU: NVRTC only), names aside.

For a change that must leave existing variants alone (a new template
argument, a new trailing parameter, a new mode under ``if constexpr``): both
trees' variants of ``--family`` that exist at ``--against`` are compiled with
the package's options for sm_80 and sm_90a, mangled names, internal symbol
prefixes and the parameters past the old count are normalised away, and the
PTX is compared entry by entry. Same PTX means ptxas builds the same SASS.

    python benchmarks/ptx_same.py --family gemm_latency --against 44ed5ba
    python benchmarks/ptx_same.py --family gemm_latency --against HEAD --define KBIT_LATENCY_KSPLIT=2
    python benchmarks/ptx_same.py --family gemm_mma --against HEAD --alone --match ", true, 8>"

``--alone`` compiles each variant as its own program, as the package does at
run time; without it the family is one program, where NVVM's inlining
decisions depend on every variant in it (a change to the calls of some
variants can then show as a difference in others that does not exist at run
time). ``--match TEXT`` keeps the variants whose C++ name contains TEXT.

``--define NAME=VALUE`` (repeatable) builds both trees with ``-DNAME=VALUE``:
an A/B knob's other setting, left alone by a change.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

_DUMP = r"""
import json, re, sys
from cupy_backends.cuda.libs import nvrtc
from kbit_cupy import _jit
family, arch, names, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), json.loads(sys.argv[4])
match, alone = sys.argv[5], sys.argv[6] == "1"
vs = [v for v in _jit.all_variants() if v.family == family and (not names or v.name in names)
      and match in v.name and (arch == "sm_90a" or not _jit.needs_sm90a(v.family, v.args))]
def entries(vs):
    prog = nvrtc.createProgram(_jit.render_source(family), "kbit.cu", [], [])
    for v in vs:
        nvrtc.addNameExpression(prog, v.name)
    nvrtc.compileProgram(prog, [*_jit.compile_options(), *extra, "-ftz=true", f"-arch={arch}"])
    ptx = nvrtc.getPTX(prog)
    ptx = ptx.decode() if isinstance(ptx, bytes) else ptx
    out = {}
    for e in re.split(r"(?=^\.(?:visible |weak )?\.entry )", ptx, flags=re.M)[1:]:
        out[e.split("(")[0].split()[-1]] = e
    return {v.name: out[nvrtc.getLoweredName(prog, v.name)] for v in vs}
out = {}
for group in ([[v] for v in vs] if alone else [vs]):
    out.update(entries(group))
print(json.dumps(out))
"""


def _entries(root: str, family: str, arch: str, names: list[str],
             extra: tuple[str, ...] = (), match: str = "", alone: bool = False) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": root}
    done = subprocess.run([sys.executable, "-c", _DUMP, family, arch, json.dumps(names),
                           json.dumps(list(extra)), match, "1" if alone else "0"],
                          cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"compiling {family} for {arch} in {root} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def _normalised(entry: str, params: int) -> str:
    head, body = entry.split(")", 1)
    kept = [p.rstrip(",") for p in head.split("\n") if ".param" not in p or
            int(re.search(r"_param_(\d+)", p).group(1)) < params]
    entry = "\n".join(kept) + ")" + body
    entry = re.sub(r"_ZN?\d*_INTERNAL_\w+?kbit_cu_[0-9a-f]+_\d+kbit", "INTERNAL", entry)
    entry = re.sub(r"_Z\w+?(_param_\d+)", r"SYMBOL\1", entry)  # the entry's parameters
    return re.sub(r"_Z\w+", "SYMBOL", entry)  # mangled names (the entry's, its locals')


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--family", required=True, help="kernels_src file stem, e.g. gemm_latency")
    p.add_argument("--against", required=True, help="a commit of this repository")
    p.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                   help="build both trees with -DNAME=VALUE (repeatable)")
    p.add_argument("--match", default="", metavar="TEXT",
                   help="only the variants whose C++ name contains TEXT, e.g. ', true>'")
    p.add_argument("--alone", action="store_true",
                   help="each variant its own program, as get_kernel builds it at run time (slower); "
                        "one program for the family inlines across variants, so a change to one "
                        "variant's calls can change another's PTX there and not at run time")
    p.add_argument("--arch", choices=("sm_80", "sm_90a"), action="append",
                   help="only this arch (repeatable; default both)")
    args = p.parse_args()
    extra = tuple(f"-D{d}" for d in args.define)
    here = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True,
                          check=True).stdout.strip()
    differ = compared = gone = 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(["git", "-C", here, "worktree", "add", "--detach", "-q", tmp, args.against],
                       check=True)
        try:
            for arch in args.arch or ("sm_80", "sm_90a"):
                old = _entries(tmp, args.family, arch, [], extra, args.match, args.alone)
                new = _entries(here, args.family, arch, sorted(old), extra, args.match, args.alone)
                for name, entry in old.items():
                    if name not in new:  # (a variant this tree no longer launches)
                        gone += 1
                        print(f"{arch} GONE    {name}")
                        continue
                    params = entry.split(")", 1)[0].count(".param")
                    same = _normalised(entry, params) == _normalised(new[name], params)
                    differ += not same
                    compared += 1
                    print(f"{arch} {'same   ' if same else 'DIFFERS'} {name}")
        finally:
            subprocess.run(["git", "-C", here, "worktree", "remove", "--force", tmp], check=False)
    if not compared:
        print(f"no {args.family} variant at {args.against} matches {args.match!r}: nothing compared")
        return 2
    print(f"{differ} variant(s) differ" + (f"; {gone} not in this tree's variant list" if gone else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
