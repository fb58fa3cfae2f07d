"""Inductor's C++ kernels of an fxquant compile, built a few to a library as code generation emits them.

Inductor's C++ backend (Python wrapper) builds every kernel into a library of its own: one g++ call per
kernel, which on the 2-core box costs about 1 s before the kernel's size counts (the precompiled header loaded
by the compiler front end, the link against libtorch_cpu's symbol table), and it starts those builds only
once the graph's wrapper module is loaded, after the last kernel is generated. A quantized graph has many
more kernels than a plain one (benchmarks/RESULTS.md), so both costs grow with quantization.

While a compile of fxquant's runs (Inductor's ``post_grad_custom_post_pass`` is fxquant's cache-key pass,
``passes.cache_key``, for the forward and the backward graph alike, and for graphs loaded from the caches),
``install``'s two wrappers change that:

* ``PythonWrapperCodegen.define_kernel``: each C++ kernel's ``async_compile.cpp_pybinding(arg_types,
  source)`` line is read as it is defined and the kernel joins the open bundle; a bundle of
  ``KERNELS_PER_BUNDLE`` kernels is submitted to Inductor's compile workers at once (the last, partial one
  of a graph as two halves when the wrapper module asks for its first kernel), as one translation
  unit: each kernel (its ``extern "C"`` dropped) in a namespace of its own, with Inductor's own Python
  binding (``CppPythonBindingsCodeCache.suffix_template``) as module ``kernel_<i>``, the first as
  ``kernel``, so that ``CppPythonBindingsCodeCache.load_async`` builds and loads it with Inductor's flags,
  vector ISA and precompiled header, under a key of its source and command line.
* ``AsyncCompile.cpp_pybinding``: the wrapper module's request for a kernel of a bundle returns a future of
  that bundle's function (submitting a bundle still open); the same kernel code, in another library.

Each bundle's source and an index from kernel to bundle are kept under Inductor's cache directory
(``fxquant_cpp_bundles/``), so a graph loaded from Inductor's FX-graph cache finds its kernels' bundles built.
A bundle that fails to build or load falls back to Inductor's own build of each kernel it holds (logged).
Plain ``torch.compile`` in the same process is left as it is, and so is any compile with one compile thread,
off Linux, or where torch's internals differ (docs/compile.md, "Compile time").
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import re
import sys
import threading
from pathlib import Path

log = logging.getLogger(__name__)

KERNELS_PER_BUNDLE = 6
STORE = "fxquant_cpp_bundles"  # under Inductor's cache directory: bundle sources and the kernel index
_PREFIX = "async_compile.cpp_pybinding("
_EXTERN_C = re.compile(r'extern\s+"C"\s+(?=[^;{()]*\bkernel\s*\()')
_lock = threading.Lock()
_installed: list[bool] = []
_known: dict[tuple, tuple[_Bundle, int]] = {}  # (arg types, source) -> (bundle, member index)
_stored: dict[str, _Bundle] = {}  # digest of a bundle read back from the store -> its one _Bundle
_open: list[_Bundle] = []
_counts = {"kernels": 0, "bundles": 0, "fallbacks": 0}


def counts() -> dict[str, int]:
    """Kernels put in bundles, bundles submitted, and kernels built alone after a bundle failed, so far in
    this process."""
    return dict(_counts)


def _active() -> bool:
    from torch._inductor import config
    from torch._inductor.async_compile import get_compile_threads

    from fxquant.passes.cache_key import FxquantCacheKey

    return isinstance(config.post_grad_custom_post_pass, FxquantCacheKey) and get_compile_threads() > 1


def _store() -> Path:
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / STORE


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def _kernel_key(argtypes: list[str], source: str) -> str:
    import torch

    return _digest(torch.__version__, repr(list(argtypes)), source)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _member_source(argtypes: list[str], source: str, index: int) -> tuple[list[str], str]:
    """(preprocessor lines to hoist, namespaced body) of one kernel with Inductor's binding as ``kernel_<i>``."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Cache

    name = "kernel" if index == 0 else f"kernel_{index}"
    parseargs = ", ".join(f"parse_arg<{t.replace('const ', '')}>(args, {n})" for n, t in enumerate(argtypes))
    suffix = Cache.suffix_template.format(arg_len=len(argtypes), call_entry_func=Cache.call_entry_function.format(
        parseargs), entry_func=name, extra_parse_arg=Cache.extra_parse_arg.format(array_len=-1))
    code, found = _EXTERN_C.subn("", source, count=1)
    if found != 1:
        raise ValueError("kernel entry point not found")
    hoisted, body = [], []
    for line in (code + "\n" + suffix).splitlines():
        s = line.strip()
        (hoisted if s.startswith("#include") or s == "#define PY_SSIZE_T_CLEAN" else body).append(line)
    return hoisted, f"namespace fxquant_bundle_{index} {{\n" + "\n".join(body) + f"\n}}  // fxquant_bundle_{index}\n"


def bundle_source(members: list[tuple[list[str], str]]) -> str:
    """One translation unit holding ``members`` ((arg types, kernel source) as Inductor generated them)."""
    hoisted: list[str] = []
    bodies = []
    for i, (argtypes, source) in enumerate(members):
        lines, body = _member_source(argtypes, source, i)
        hoisted += [ln for ln in lines if ln not in hoisted]
        bodies.append(body)
    return "\n".join(hoisted) + "\n\n" + "\n".join(bodies)


def _reraise(exc: Exception):
    raise exc


class _Bundle:
    """Kernels built as one library; ``function(i)`` is member i's Python-callable entry point."""

    def __init__(self, code: str | None = None) -> None:
        self.members: list[tuple[list[str], str]] = []
        self.code = code
        self.load = None
        self.lock = threading.Lock()

    def add(self, argtypes: list[str], source: str) -> int:
        self.members.append((list(argtypes), source))
        return len(self.members) - 1

    def submit(self) -> None:
        """Start the build (once): Inductor's code cache writes, keys and builds it on its compile workers."""
        from torch._inductor.async_compile import AsyncCompile
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        with self.lock:
            if self.load is not None:
                return
            try:
                if self.code is None:
                    self.code = bundle_source(self.members)
                    store = _store()
                    digest = _digest(self.code)
                    _write(store / "bundles" / f"{digest}.cpp", self.code)
                    for i, (argtypes, source) in enumerate(self.members):
                        _write(store / "kernels" / _kernel_key(argtypes, source), f"{digest} {i}\n")
                    _counts["bundles"] += 1
                self.load = CppPythonBindingsCodeCache.load_async(self.code, "cpu", submit_fn=AsyncCompile.submit)
            except Exception as exc:  # noqa: BLE001  (each member falls back to Inductor's own build)
                self.load = functools.partial(_reraise, exc)

    def function(self, index: int, argtypes: list[str], source: str):
        try:
            self.submit()
            first = self.load()
            if index == 0:
                return first.kernel
            name = f"{first.__name__.rsplit('.', 1)[0]}.kernel_{index}"
            module = sys.modules.get(name)
            if module is None:
                spec = importlib.util.spec_from_file_location(name, first.__file__)
                module = importlib.util.module_from_spec(spec)
                sys.modules[name] = module
                spec.loader.exec_module(module)
            return getattr(module, f"kernel_{index}")
        except Exception:  # noqa: BLE001  (Inductor's own build of this kernel, which reports its errors itself)
            log.warning("fxquant: a bundle of C++ kernels did not build or load; building its kernel alone",
                        exc_info=True)
            from torch._inductor.codecache import CppPythonBindingsCodeCache

            _counts["fallbacks"] += 1
            return CppPythonBindingsCodeCache.load_pybinding(argtypes, source)


class _Capture:
    """Stands in for ``async_compile`` to read a kernel line's arguments."""

    @staticmethod
    def cpp_pybinding(argtypes, source_code):
        return list(argtypes), source_code


def _defined(kernel_body: str) -> None:
    try:
        argtypes, source = eval(kernel_body, {"__builtins__": {}, "async_compile": _Capture()})  # noqa: S307
    except Exception:  # noqa: BLE001  (left to Inductor's own build)
        log.debug("C++ kernel line not understood; left to Inductor", exc_info=True)
        return
    with _lock:
        key = (tuple(argtypes), source)
        if key in _known:
            return
        if not _open:
            _open.append(_Bundle())
        bundle = _open[0]
        _known[key] = (bundle, bundle.add(argtypes, source))
        _counts["kernels"] += 1
        full = len(bundle.members) >= KERNELS_PER_BUNDLE
        if full:
            _open.clear()
    if full:
        bundle.submit()


def _split(bundle: _Bundle) -> None:
    """Share an unsubmitted bundle's kernels between two bundles (two compile workers; caller holds _lock)."""
    if len(bundle.members) < 2:
        return
    half = (len(bundle.members) + 1) // 2
    parts = (_Bundle(), _Bundle())
    for i, (argtypes, source) in enumerate(bundle.members):
        part = parts[i >= half]
        _known[(tuple(argtypes), source)] = (part, part.add(argtypes, source))


def _requested(argtypes: list[str], source: str) -> tuple[_Bundle, int] | None:
    """The bundle and member index that hold this kernel: this process's, or one in the store."""
    key = (tuple(argtypes), source)
    with _lock:
        found = _known.get(key)
        if found is not None and _open and found[0] is _open[0]:
            _split(_open.pop())  # the graph's wrapper module is loading: its last bundle is complete
            found = _known[key]
    if found is not None:
        return found
    store = _store()
    try:
        digest, index = (store / "kernels" / _kernel_key(argtypes, source)).read_text().split()
        with _lock:
            bundle = _stored.get(digest)
        if bundle is None:  # read, keyed and loaded once for all the kernels it holds
            bundle = _Bundle((store / "bundles" / f"{digest}.cpp").read_text())
    except (OSError, ValueError):
        return None
    with _lock:
        return _known.setdefault(key, (_stored.setdefault(digest, bundle), int(index)))


def install() -> bool:
    """Wrap Inductor's kernel definition and kernel request once per process; False where this torch lacks
    them (or off Linux)."""
    with _lock:
        if _installed:
            return _installed[0]
        try:
            if not sys.platform.startswith("linux"):
                raise ImportError("bundles are built on Linux only")
            from torch._inductor import async_compile, codecache
            from torch._inductor.codegen.wrapper import PythonWrapperCodegen

            AsyncCompile = async_compile.AsyncCompile
            async_compile.get_compile_threads  # noqa: B018

            define, request = PythonWrapperCodegen.define_kernel, AsyncCompile.cpp_pybinding
            cache = codecache.CppPythonBindingsCodeCache
            cache.suffix_template, cache.call_entry_function, cache.extra_parse_arg, cache.load_async  # noqa: B018
            future = codecache.LambdaFuture
        except (ImportError, AttributeError) as exc:
            log.debug("C++ kernels built one to a library: %s", exc)
            _installed.append(False)
            return False

        @functools.wraps(define)
        def define_kernel(self, kernel_name, kernel_body, *args, **kwargs):
            if isinstance(kernel_body, str) and kernel_body.startswith(_PREFIX) and _active():
                _defined(kernel_body)
            return define(self, kernel_name, kernel_body, *args, **kwargs)

        @functools.wraps(request)
        def cpp_pybinding(self, argtypes, source_code, *args, **kwargs):
            if not args and not kwargs and _active():
                found = _requested(argtypes, source_code)
                if found is not None:
                    bundle, index = found
                    bundle.submit()
                    return future(functools.partial(bundle.function, index, list(argtypes), source_code))
            return request(self, argtypes, source_code, *args, **kwargs)

        PythonWrapperCodegen.define_kernel = define_kernel
        AsyncCompile.cpp_pybinding = cpp_pybinding
        _installed.append(True)
        return True
