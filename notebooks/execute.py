"""Execute the notebooks top to bottom and save them with their outputs.

usage: python notebooks/execute.py [OUT_DIR]

Writes each executed notebook to OUT_DIR (default: in place). Needs nbclient
and ipykernel (``pip install -e ".[test]"``). On a GPU machine the notebooks
use the CUDA kernels; without one, the NumPy path.
"""

import sys
import time
from pathlib import Path

import nbclient
import nbformat

HERE = Path(__file__).resolve().parent


def main() -> int:
    out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(HERE.glob("*.ipynb")):
        t0 = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                                resources={"metadata": {"path": str(HERE)}}).execute()
        nbformat.write(nb, out_dir / path.name)
        print(f"{path.name}: {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
