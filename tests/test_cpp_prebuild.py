"""fxquant.cpp_prebuild: an fxquant compile's C++ kernels built a few to a library, as code generation emits them."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fxquant import cpp_prebuild

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from pathlib import Path
    import torch
    from torch import nn
    from torch._inductor.codecache import CppPythonBindingsCodeCache as Cache

    import fxquant
    from fxquant import cpp_prebuild

    def model():
        torch.manual_seed(0)  # no bias: its grad is a sum whose order differs from the eager reference's
        return nn.Sequential(nn.Linear(64, 128, bias=False), nn.ReLU(), nn.Linear(128, 64, bias=False))

    def step(m, x):
        x = x.detach().requires_grad_(True)
        y = m(x)
        y.square().sum().backward()
        return [y, x.grad, *(p.grad for p in m.parameters())]

    def libraries():
        return len(list(Path({cache!r}).rglob("*.so")))

    x = torch.randn(32, 64)
    before, libs = len(Cache.cache), libraries()
    got = step(fxquant.compile(model(), "linear_mxfp8"), x)
    built, c = len(Cache.cache) - before, cpp_prebuild.counts()
    want = step(fxquant.compile(model(), "linear_mxfp8", backend="eager"), x)
    assert all(torch.equal(a, b) for a, b in zip(got, want)), "compiled != eager reference"
    print("COUNTS", c, "BUILT", built, "LIBRARIES", libraries() - libs)
    if {warm}:  # graphs from the FX-graph cache: their kernels' bundles found in the store, nothing built
        assert c["kernels"] == 0 and c["bundles"] == 0 and libraries() == libs, (c, libraries(), libs)
        assert built > 0 and c["fallbacks"] == 0, (built, c)
        stored = len(list(Path({cache!r}, cpp_prebuild.STORE, "bundles").iterdir()))
        assert len(cpp_prebuild._stored) == stored, (cpp_prebuild._stored, stored)  # each bundle read back once
    else:  # several kernels a library, every library a bundle (none built alone)
        assert 0 < c["bundles"] < c["kernels"] and built == c["bundles"] and c["fallbacks"] == 0, (c, built)
        before = len(Cache.cache)
        plain = torch.compile(nn.Sequential(nn.Linear(64, 32), nn.Tanh()))
        plain(x).sum().backward()
        assert len(Cache.cache) > before and cpp_prebuild.counts() == c  # plain torch.compile left as it is
""")


def _child(cache: Path, warm: bool) -> str:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCHINDUCTOR_COMPILE_THREADS": "2"}
    run = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT), cache=str(cache), warm=warm)],
                         capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


@pytest.mark.slow
def test_fxquant_compile_builds_its_kernels_in_bundles_and_a_rerun_loads_them(tmp_path):
    """In a fresh process on an empty Inductor cache, an fxquant compile (forward and backward graph) builds
    its C++ kernels as bundles of several, equal to the eager reference bit for bit, and a plain
    ``torch.compile`` afterwards builds its kernels Inductor's way; a second fresh process on that cache loads
    the graphs from Inductor's FX-graph cache and their kernels from the bundles, building nothing."""
    assert "COUNTS" in _child(tmp_path, warm=False)
    assert "COUNTS" in _child(tmp_path, warm=True)


_ADD = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0, float* out_ptr0)
{{
    for (long i = 0; i < 8; i++) {{ out_ptr0[i] = in_ptr0[i] + {c}.0f; }}
}}
"""
_ARGS = ["const float*", "float*"]


def _run(fn) -> torch.Tensor:
    x, out = torch.arange(8, dtype=torch.float32), torch.empty(8)
    fn(x, out)
    return out - x


def test_bundle_source_namespaces_each_kernel_with_its_binding():
    code = cpp_prebuild.bundle_source([(_ARGS, _ADD.format(c=1)), (_ARGS, _ADD.format(c=2))])
    assert code.count("#include <torch/csrc/inductor/cpp_prefix.h>") == 1  # hoisted once
    assert 'extern "C"  void  kernel(' not in code
    for i, name in enumerate(["kernel", "kernel_1"]):
        assert f"namespace fxquant_bundle_{i} {{" in code and f"PyInit_{name}(" in code
    with pytest.raises(ValueError, match="entry point"):
        cpp_prebuild.bundle_source([(_ARGS, "void f() {}")])


@pytest.mark.slow
def test_bundle_members_run_their_own_kernel_and_a_broken_bundle_falls_back(tmp_path, monkeypatch):
    """A real two-kernel bundle built by Inductor's code cache: each member is its own kernel. A bundle whose
    source does not compile gives each kernel Inductor's own build instead (counted as a fallback)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    members = [(_ARGS, _ADD.format(c=1)), (_ARGS, _ADD.format(c=2))]
    bundle = cpp_prebuild._Bundle()
    for argtypes, source in members:
        bundle.add(argtypes, source)
    assert torch.equal(_run(bundle.function(0, *members[0])), torch.full((8,), 1.0))
    assert torch.equal(_run(bundle.function(1, *members[1])), torch.full((8,), 2.0))
    assert len(list((tmp_path / "fxquant_cpp_bundles" / "kernels").iterdir())) == 2  # indexed for a rerun

    before = cpp_prebuild.counts()["fallbacks"]
    broken = cpp_prebuild._Bundle(code="#error not a kernel\n")
    assert torch.equal(_run(broken.function(0, _ARGS, _ADD.format(c=3))), torch.full((8,), 3.0))
    assert cpp_prebuild.counts()["fallbacks"] == before + 1
    unreadable = cpp_prebuild._Bundle()  # no entry point to rename: its source cannot even be written
    unreadable.add(_ARGS, _ADD.format(c=4).replace('extern "C"', ""))
    unreadable.submit()  # does not raise: the failure is met when the member is asked for
    assert torch.equal(_run(unreadable.function(0, _ARGS, _ADD.format(c=4))), torch.full((8,), 4.0))
    assert cpp_prebuild.counts()["fallbacks"] == before + 2


def test_bundles_only_inside_fxquant_compiles_with_compile_workers():
    from torch._inductor import config

    from fxquant.passes.cache_key import FxquantCacheKey

    assert cpp_prebuild.install()
    assert cpp_prebuild.install()  # once per process
    key = FxquantCacheKey("scheme")
    with config.patch(post_grad_custom_post_pass=key, compile_threads=2):
        assert cpp_prebuild._active()
    with config.patch(post_grad_custom_post_pass=key, compile_threads=1):
        assert not cpp_prebuild._active()
    with config.patch(post_grad_custom_post_pass=None, compile_threads=2):
        assert not cpp_prebuild._active()
