"""Inductor's CPU vector-ISA probe, started early and in parallel.

Before the first C++ kernel of a process, Inductor checks which vector instruction sets (AVX-512 VNNI, AVX-512,
AVX2 on x86) it can build for: per candidate it compiles a test program against ATen's vector headers and
loads it in a child Python (``torch._inductor.cpu_vec_isa``, ``VecISA.check_build``), one candidate after the
other, the first time code generation asks. Compiled results land in Inductor's cache directory; with an
empty one the probe took 6.0-8.4 s of plain ``torch.compile``'s 19.3-21.6 s cold compile of the torch test model on the
2-core box (docs/compile.md, "Compile time").

``start`` runs the same checks, one background thread per candidate, when ``fxquant.compile`` is called for a
model on the CPU under Inductor: the probes (a compiler and a child process each, no torch ops in the
thread) then overlap with Dynamo's and AOT autograd's tracing of the first call, and each other, instead of
running serially inside code generation. Inductor's own call later finds each answer cached (``VecISA``
memoises it per candidate; a candidate still being probed is waited for through the probe's file lock, and
nothing is built twice). Where torch lacks these internals, or the ISA is forced (``cpp.vec_isa_ok``), it does
nothing.
"""
from __future__ import annotations

import logging
import platform
import sys
import threading

log = logging.getLogger(__name__)
_lock = threading.Lock()
_started: list[threading.Thread] = []


def candidates() -> list[object]:
    """The ISAs Inductor would probe on this machine (``valid_vec_isa_list``'s x86 filter); [] where it probes
    nothing, is told the answer, or this torch's internals differ."""
    if sys.platform not in ("linux", "win32") or platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        from torch._inductor import config, cpu_vec_isa

        if config.cpp.vec_isa_ok is not None or config.is_fbcode():
            return []
        flags = cpu_vec_isa.x86_isa_checker()
        return [isa for isa in cpu_vec_isa.supported_vec_isa_list if all(f in flags for f in str(isa).split())]
    except (ImportError, AttributeError) as exc:
        log.debug("vector-ISA probe not started: %s", exc)
        return []


def _probe(isa: object) -> None:
    try:
        log.debug("vector ISA %s: %s", isa, "usable" if bool(isa) else "not usable")
    except Exception:  # noqa: BLE001  (Inductor probes again and reports it itself)
        log.debug("vector-ISA probe of %s failed", isa, exc_info=True)


def start() -> list[threading.Thread]:
    """Start the probes once per process (later calls return the same threads); the threads are daemons."""
    with _lock:
        if not _started:
            for isa in candidates():
                t = threading.Thread(target=_probe, args=(isa,), name=f"fxquant-isa-probe-{isa}", daemon=True)
                t.start()
                _started.append(t)
        return list(_started)


def wait() -> None:
    """Join the probes started (none: returns at once). Inductor's ``VecAVX512.__bool__`` adds
    ``-mavx512bf16`` to the instance's flags for the length of its bf16 check build, so a command line built
    while a probe runs could carry it: a compile that reads the ISA (code generation, the kernels of a graph
    loaded from the FX-graph cache) waits for them first, and its command lines, hence its kernel cache keys,
    are the same in every process."""
    with _lock:
        threads = list(_started)
    for t in threads:
        t.join()
