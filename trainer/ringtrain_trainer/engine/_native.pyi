"""Types of the compiled kernels (``_native.c``)."""

from typing_extensions import Buffer

def isa() -> str: ...
def gemm_nt(a: Buffer, w: Buffer, out: Buffer, M: int, N: int, K: int) -> None: ...
def pool_relu(conv: Buffer, bias: Buffer, out: Buffer, win: Buffer, P: int, F: int) -> None: ...
def unpool(dout: Buffer, win: Buffer, dconv: Buffer, P: int, F: int) -> None: ...
def depthwise_forward(xp: Buffer, kernel: Buffer, z: Buffer, dims: tuple[int, ...]) -> None: ...
def depthwise_backward(
    xp: Buffer,
    dz: Buffer,
    kernel: Buffer,
    dkernel: Buffer,
    dxp: Buffer | None,
    dims: tuple[int, ...],
) -> None: ...
def all_finite(a: Buffer) -> bool: ...
def add_scale(out: Buffer, other: Buffer, scale: float) -> None: ...
def gemm(a: Buffer, row: Buffer, red: Buffer, b: Buffer, out: Buffer, N: int) -> None: ...
def use(name: str) -> str: ...
def adam_update(
    g: Buffer,
    w: Buffer,
    m: Buffer,
    v: Buffer,
    c1: float,
    c2: float,
    eps: float,
    alpha: float,
    threads: int = 1,
) -> None: ...
def convpool_input_grad(
    kernel_t: Buffer,
    dout: Buffer,
    idx: Buffer,
    dx: Buffer,
    B: int,
    H: int,
    W: int,
    C: int,
    K: int,
    F: int,
) -> None: ...
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
