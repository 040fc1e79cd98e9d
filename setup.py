"""The engine's compiled kernels (trainer/ringtrain_trainer/engine/native.py says why): plain C
against Python's headers, built by every install (hack/setup's editable one and the image's).
Everything else about the project is in pyproject.toml; the extension is declared here because
setuptools calls pyproject's ``[tool.setuptools.ext-modules]`` experimental and warns so on every
build (docs/decisions/0203-demo-installs-the-runtime-only.md).

-ffp-contract=off: no fused multiply-add but the kernels' own, so every instruction set gives the
same bits; -fno-math-errno: sqrtf vectorises (Adam's step, 3.5x).
"""

from glob import glob

from setuptools import Extension, setup

ENGINE = "trainer/ringtrain_trainer/engine"

setup(
    ext_modules=[
        Extension(
            "ringtrain_trainer.engine._native",
            sources=[f"{ENGINE}/_native.c"],
            depends=sorted(glob(f"{ENGINE}/*.h")),
            extra_compile_args=["-O3", "-ffp-contract=off", "-fno-math-errno", "-Wno-psabi"],
        )
    ]
)
