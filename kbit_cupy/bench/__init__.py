"""Benchmarks and figures: what ``python -m kbit_cupy bench*`` and ``plot`` run.

Not part of the library's API (``kbit_cupy`` does not import it):

- ``harness``: cold-L2 kernel timing on CUDA events, the in-run cuBLAS
  baseline, GPU facts, results files (JSON + markdown), progress;
- ``gemm``, ``moe``, ``format``, ``decode``: the ``bench`` / ``bench-gemm``,
  ``bench-moe``, ``bench-format`` and ``bench-decode`` commands;
- ``plots``: the speedup and roofline figures from saved results;
- ``cli``: those commands' arguments, added to ``python -m kbit_cupy``.

Everything imports without a GPU; CuPy is imported when a benchmark runs.
"""
