"""The optional native extension of the SSD store's batched row reads and writes.

Everything else is declared in pyproject.toml. ``optional=True``: where no C compiler
(or no Python headers) is found, the build goes on without it and the store uses its
pure-Python path (``towerrec.modules.row_io``).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "towerrec.modules._rowio",
            sources=["src/towerrec/modules/_rowio.c"],
            extra_compile_args=["-O2", "-std=gnu11"],
            optional=True,
        )
    ]
)
