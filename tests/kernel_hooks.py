"""Which Triton kernels ran: pre-run hooks on the kernels themselves, for tests that route an op to Triton and
must show the kernels ran (the op's reference would give the same values)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def launches_of(*kernels):
    """Yield a list that gets the ``__name__`` of each launch of ``kernels`` (Triton JIT functions) inside the
    block, in launch order."""
    names: list[str] = []
    hooks = []
    for k in kernels:
        hook = lambda *args, _name=k.__name__, **kw: names.append(_name)  # noqa: E731
        k.add_pre_run_hook(hook)
        hooks.append((k, hook))
    try:
        yield names
    finally:
        for k, hook in hooks:
            k.pre_run_hooks.remove(hook)
