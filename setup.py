"""The optional native extensions: the SSD store's batched row reads and writes, the
fused CPU kernels of the training step (the pairwise dot interaction, the small tables'
row gradients), and the host bookkeeping of cached tables.

Everything else is declared in pyproject.toml. ``optional=True``: where no C compiler
(or no Python headers) is found, the build goes on without them: the store uses its pure-Python path
(``towerrec.modules.row_io``), the interaction its batched matmuls
(``towerrec.modules.interaction``), the row gradients PyTorch's ``index_add_`` and the
caches' bookkeeping its tensor operations (``towerrec.modules.table_cache``).

The fused kernels split their work among OpenMP's threads where the compiler takes
``-fopenmp`` (the threads torch's CPU operators run on: modules/_fused.c, run_split), and
among POSIX threads of their own where it does not.
"""

import os
import tempfile

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

OPENMP_PROBE = "#include <omp.h>\nint main(void) { return omp_get_max_threads() < 1; }\n"


class BuildExt(build_ext):
    """``build_ext`` that adds ``-fopenmp`` to the extensions that ask for it
    (``openmp = True``) where a probe program compiles and links with it."""

    def _openmp_works(self) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            source = os.path.join(tmp, "probe.c")
            with open(source, "w") as f:
                f.write(OPENMP_PROBE)
            try:
                objects = self.compiler.compile(
                    [source], output_dir=tmp, extra_postargs=["-fopenmp"]
                )
                self.compiler.link_executable(
                    objects, "probe", output_dir=tmp, extra_postargs=["-fopenmp"]
                )
            except Exception:  # any compile or link failure: build without OpenMP
                return False
        return True

    def build_extensions(self) -> None:
        wanted = [e for e in self.extensions if getattr(e, "openmp", False)]
        if wanted and self._openmp_works():
            for ext in wanted:
                ext.extra_compile_args = [*ext.extra_compile_args, "-fopenmp"]
                ext.extra_link_args = [*ext.extra_link_args, "-fopenmp"]
        super().build_extensions()


fused = Extension(
    "towerrec.modules._fused",
    sources=["src/towerrec/modules/_fused.c"],
    depends=["src/towerrec/modules/_fused_lanes.h"],  # its kernels at each vector width
    extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi", "-pthread"],
    extra_link_args=["-pthread"],
    optional=True,
)
fused.openmp = True  # type: ignore[attr-defined]  # read by BuildExt

setup(
    cmdclass={"build_ext": BuildExt},
    ext_modules=[
        Extension(
            "towerrec.modules._rowio",
            sources=["src/towerrec/modules/_rowio.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        fused,
        Extension(
            "towerrec.modules._cache",
            sources=["src/towerrec/modules/_cache.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
    ],
)
