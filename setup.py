"""The optional native extensions: the SSD store's batched row reads and writes, the
fused CPU kernels of the training step (the pairwise dot interaction, the small tables'
row gradients), and the host bookkeeping of cached tables.

Everything else is declared in pyproject.toml. ``optional=True``: where no C compiler
(or no Python headers) is found, the build goes on without them: the store uses its pure-Python path
(``towerrec.modules.row_io``), the interaction its batched matmuls
(``towerrec.modules.interaction``), the row gradients PyTorch's ``index_add_`` and the
caches' bookkeeping its tensor operations (``towerrec.modules.table_cache``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "towerrec.modules._rowio",
            sources=["src/towerrec/modules/_rowio.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
        Extension(
            "towerrec.modules._fused",
            sources=["src/towerrec/modules/_fused.c"],
            extra_compile_args=["-O3", "-std=gnu11", "-ffp-contract=off", "-Wno-psabi", "-pthread"],
            extra_link_args=["-pthread"],
            optional=True,
        ),
        Extension(
            "towerrec.modules._cache",
            sources=["src/towerrec/modules/_cache.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        ),
    ]
)
