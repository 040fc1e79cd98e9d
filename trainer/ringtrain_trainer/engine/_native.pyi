"""Types of the compiled kernels (``_native.c``)."""

from typing_extensions import Buffer

def isa() -> str: ...
def convpool_forward(
    x: Buffer,
    kernel: Buffer,
    bias: Buffer,
    out: Buffer,
    idx: Buffer,
    B: int,
    H: int,
    W: int,
    C: int,
    K: int,
    F: int,
) -> None: ...
def convpool_backward(
    x: Buffer,
    dout: Buffer,
    idx: Buffer,
    dkernel: Buffer,
    dbias: Buffer,
    B: int,
    H: int,
    W: int,
    C: int,
    K: int,
    F: int,
) -> None: ...
