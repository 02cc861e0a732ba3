"""The optional native extensions: the SSD store's batched row reads and writes, and the
fused CPU kernels of the training step (the pairwise dot interaction, the small tables'
row gradients).

Everything else is declared in pyproject.toml. ``optional=True``: where no C compiler
(or no Python headers) is found, the build goes on without them: the store uses its pure-Python path
(``towerrec.modules.row_io``), the interaction its batched matmuls
(``towerrec.modules.interaction``) and the row gradients PyTorch's ``index_add_``.
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
    ]
)
