"""Where a kernel's warps wait, by reason, by opcode and by instruction, from
ncu's source page (``ncu --import REPORT --page source --csv``, as
``knob_first_run.sh moe-ncu-source`` writes it, gzipped or not).

usage: python benchmarks/ncu_source_summary.py FILE.csv[.gz] [--top 25]

Prints the warp-state samples (ncu's "Warp Stall Sampling (All Samples)")
as shares of the kernel's total: per stall reason, per opcode (the first
word of the SASS line, predicate dropped) with its two largest reasons, and
the ``--top`` instructions with their address, SASS and largest reasons.
A file with several kernels is summed as one.
"""

from __future__ import annotations

import argparse
import collections
import csv
import gzip
import io
import sys

TOTAL = "Warp Stall Sampling (All Samples)"


def read_rows(path: str) -> list[dict]:
    """The instruction rows of every kernel in the file (the header rows
    of each kernel's block dropped)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", newline="") as f:
        text = f.read()
    rows, header = [], None
    for rec in csv.reader(io.StringIO(text)):
        if not rec:
            continue
        if rec[0] == "Address":
            header = rec
            continue
        if header is None or len(rec) != len(header):
            continue  # "Kernel Name" lines, ncu's messages
        rows.append(dict(zip(header, rec)))
    return rows


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("file")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args()
    rows = read_rows(args.file)
    if not rows or TOTAL not in rows[0]:
        print(f"{args.file}: no ncu source rows with '{TOTAL}' (was it run with "
              "--section SourceCounters --section WarpStateStats?)", file=sys.stderr)
        return 1
    reasons = [k for k in rows[0] if k.startswith("stall_") and not k.endswith("(Not Issued)")]
    total = sum(number(r[TOTAL]) for r in rows) or 1.0
    print(f"{args.file}: {len(rows)} instructions, {total:.0f} samples")

    by_reason = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    for r in rows:
        op = opcode(r["Source"])
        for k in reasons:
            v = number(r[k])
            by_reason[k] += v
            by_op[op][k] += v
    print("\nby reason (share of all samples):")
    for k, v in by_reason.most_common():
        if v / total >= 0.005:
            print(f"  {k[6:]:<18} {100 * v / total:5.1f}%")

    def top2(c: collections.Counter) -> str:
        return ", ".join(f"{k[6:]} {100 * v / total:.1f}%" for k, v in c.most_common(2) if v)

    print("\nby opcode:")
    ops = sorted(by_op.items(), key=lambda kv: -sum(kv[1].values()))
    for op, c in ops:
        s = sum(c.values())
        if s / total >= 0.005:
            print(f"  {op:<10} {100 * s / total:5.1f}%  ({top2(c)})")

    print(f"\ntop {args.top} instructions:")
    ranked = sorted(rows, key=lambda r: -number(r[TOTAL]))[: args.top]
    for r in ranked:
        c = collections.Counter({k: number(r[k]) for k in reasons})
        print(f"  {r['Address'][-5:]:>6} {100 * number(r[TOTAL]) / total:5.1f}%  "
              f"{r['Source'].strip()[:60]:<60} ({top2(c)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
