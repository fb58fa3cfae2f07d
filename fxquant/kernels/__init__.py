"""fxquant.kernels: Triton kernels for ``fxquant::quantize``, bit-identical to the reference in fxquant.formats.

    >>> from fxquant import kernels
    >>> from fxquant.formats.tensor_quant import TensorQuant
    >>> y = kernels.quantize(x_cuda, TensorQuant("mxfp8_e4m3"), dim=-1)   # == the reference, bit for bit

Importing this package registers the Triton implementation of ``torch.ops.fxquant.quantize`` for CUDA
when Triton is importable and a CUDA device is present (the op's default implementation stays the
pure-torch reference). Triton itself is imported lazily, by the first launch or ``register``, so that a
test can set ``TRITON_INTERPRET=1`` first; then ``register(device="cpu")`` routes the op's CPU
implementation through Triton's interpreter (ARCHITECTURE.md trap 7). The kernels: ``_quantize.py``;
their device functions: ``_primitives.py``; the wrappers: ``launch.py``. Contract: FORMATS.md.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
import os

import torch

log = logging.getLogger(__name__)

__all__ = ["available", "check_interpreter_loops", "has_kernel", "interpreter_loop_problem", "quantize", "register",
           "registered", "restore_reference", "takes"]

DEVICES = ("cuda", "cpu")
_TRITON_DEVICES: set[str] = set()  # devices whose fxquant::quantize implementation is the Triton kernels


def available() -> bool:
    """Whether Triton is importable (the kernels also need a CUDA device, or TRITON_INTERPRET=1 on CPU)."""
    return importlib.util.find_spec("triton") is not None


def _release(version: str) -> tuple[int, int]:
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def interpreter_loop_problem(triton_version: str, numpy_version: str) -> str | None:
    """Why Triton's interpreter cannot run a kernel whose loop bound is a kernel argument (the flash-attention and
    GEMM kernels) with these versions, or None. Triton before 3.7 reads such a bound with ``int()`` of a
    one-element numpy array, which numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"); torch 2.11 pins Triton 3.6."""
    if _release(triton_version) < (3, 7) and _release(numpy_version) >= (2, 4):
        return (f"Triton {triton_version}'s interpreter cannot run fxquant's flash-attention and GEMM kernels with "
                f"numpy {numpy_version}: it converts their loop bounds with int() of a one-element array, which numpy "
                "2.4 refuses (fixed in Triton 3.7); install numpy<2.4 or triton>=3.7")
    return None


@functools.lru_cache(maxsize=None)
def check_interpreter_loops() -> None:
    """Raise ``RuntimeError`` with ``interpreter_loop_problem``'s reason for the installed Triton and numpy."""
    problem = interpreter_loop_problem(importlib.metadata.version("triton"), importlib.metadata.version("numpy"))
    if problem is not None:
        raise RuntimeError(problem)


def quantize(x: torch.Tensor, tq, dim: int = -1, seed: int | None = None) -> torch.Tensor:
    """Fake-quantize ``x`` along ``dim`` per the TensorQuant ``tq`` with the Triton kernels.

    Same contract and result as ``tq.quantize(x, dim, seed=seed)``, the straight-through gradient included;
    ``x`` must be a CUDA tensor, or a CPU tensor when the kernels run in Triton's interpreter.
    """
    from fxquant.formats.base import straight_through
    from fxquant.kernels import launch

    return straight_through(x, lambda t: launch.quantize(t, tq, dim, seed))  # launch checks bad input


def has_kernel(fmt) -> bool:
    """Whether Triton kernels implement ``fmt``, a Format or a format name (the compatibility formats of
    formats/legacy.py are reference-only; the kernels implement every option of the others: ``takes``)."""
    from fxquant import formats
    from fxquant.formats.base import Format
    from fxquant.formats.legacy import LegacyClampFormat

    if isinstance(fmt, str):
        fmt = formats.get(fmt)  # an unknown name raises, with the known ones
    if not isinstance(fmt, Format):
        raise TypeError(f"has_kernel takes a Format or a format name, got {type(fmt).__name__}")
    return not isinstance(fmt, LegacyClampFormat)


def takes(tq) -> bool:
    """Whether the Triton kernels implement TensorQuant ``tq``: those of its format (``has_kernel``) implement
    every option, NVFP4's 16x16 tiles (``block_2d``) included."""
    return has_kernel(tq.fmt)


def _quantize_op_impl(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> torch.Tensor:
    from fxquant.ops import parse_qspec

    tq = parse_qspec(qspec)
    if not takes(tq):
        return tq.quantize(x, dim, seed=seed)
    return quantize(x, tq, dim, seed)


def _reference_op_impl(x: torch.Tensor, qspec: str, dim: int, seed: int | None = None) -> torch.Tensor:
    from fxquant.ops import parse_qspec

    return parse_qspec(qspec).quantize(x, dim, seed=seed)


def _check_device_name(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"device={device!r} is not supported; allowed: {list(DEVICES)}")


def register(device: str = "cuda") -> None:
    """Register the Triton implementation of ``fxquant::quantize`` for ``device`` (idempotent).

    ``device="cpu"`` is for tests only and needs ``TRITON_INTERPRET=1`` set before the kernels were first
    imported; ``restore_reference("cpu")`` undoes it.
    """
    _check_device_name(device)
    if not available():
        raise RuntimeError("fxquant.kernels.register needs Triton: pip install 'fxquant[triton]'")
    if device == "cpu":
        from fxquant.kernels import launch

        if not launch.INTERPRETED:  # what Triton decided (it reads TRITON_INTERPRET as 1/true/on/yes)
            raise RuntimeError(
                "device='cpu' runs the Triton kernels in Triton's interpreter and is meant for tests: set "
                f"TRITON_INTERPRET=1 (now {os.environ.get('TRITON_INTERPRET')!r}) before fxquant.kernels.launch is "
                "first imported; imported without it, its kernels are compiled for the GPU and cannot run on CPU"
            )
    import fxquant.ops  # noqa: F401  (defines the op)

    torch.library.register_kernel("fxquant::quantize", device, _quantize_op_impl)
    _TRITON_DEVICES.add(device)
    log.debug("registered the Triton implementation of fxquant::quantize for %s", device)


def registered(device: str) -> bool:
    """Whether ``fxquant::quantize`` runs the Triton kernels on ``device`` ("cuda" or "cpu")."""
    _check_device_name(device)
    return device in _TRITON_DEVICES


def restore_reference(device: str) -> None:
    """Make the pure-torch reference the implementation of ``fxquant::quantize`` for ``device`` again."""
    _check_device_name(device)
    import fxquant.ops  # noqa: F401  (defines the op)

    torch.library.register_kernel("fxquant::quantize", device, _reference_op_impl)
    _TRITON_DEVICES.discard(device)
    log.debug("fxquant::quantize on %s runs the reference again", device)


if available() and torch.cuda.is_available():
    register("cuda")
