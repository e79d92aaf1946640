"""Ships the top-level kernels_src/ inside the wheel as kbit_cupy/kernels_src/.

All metadata lives in pyproject.toml; this file only copies the CUDA sources
next to the package at build time, so an installed kbit_cupy finds them the
same way a source tree does (kbit_cupy/_jit.py: kernels_dir()).
"""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithKernels(build_py):
    def run(self):
        super().run()
        source = Path(__file__).parent / "kernels_src"
        target = Path(self.build_lib) / "kbit_cupy" / "kernels_src"
        target.mkdir(parents=True, exist_ok=True)
        for path in source.iterdir():
            if path.suffix in (".cu", ".cuh"):
                shutil.copy2(path, target / path.name)


setup(cmdclass={"build_py": BuildPyWithKernels})
