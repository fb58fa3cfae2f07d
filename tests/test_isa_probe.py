"""fxquant.isa_probe: Inductor's vector-ISA probe run ahead, in parallel, into the cache Inductor reads."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from torch import nn

from fxquant import api, isa_probe

ROOT = Path(__file__).resolve().parents[1]

_CHILD = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from torch._inductor import cpu_vec_isa
    from fxquant import isa_probe

    want = isa_probe.candidates()
    threads = isa_probe.start()
    assert isa_probe.start() == threads  # once per process
    assert len(threads) == len(want) and all(t.daemon for t in threads), (threads, want)
    for t in threads:
        t.join()

    def refuse(self, code):
        raise AssertionError(f"Inductor probed {{self}} again")

    cpu_vec_isa.VecISA.check_build = refuse  # Inductor's own probe must now find every answer cached
    valid = cpu_vec_isa.valid_vec_isa_list()
    print("CANDIDATES", [str(i) for i in want], "VALID", [str(i) for i in valid], "PICKED", cpu_vec_isa.pick_vec_isa())
    assert [str(i) for i in valid] == [str(i) for i in want if i]
""")


def test_probes_run_once_in_daemon_threads_and_inductor_reuses_their_answers():
    """In a fresh process (nothing memoised yet): after start() and the threads' end, Inductor's own ISA list is
    built without a single further probe build (check_build replaced by a failure)."""
    run = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(ROOT))], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ))
    assert run.returncode == 0, run.stderr[-3000:]
    if isa_probe.candidates():
        assert "VALID ['" in run.stdout, run.stdout  # this machine has a vector ISA Inductor can build for


def test_no_probe_where_the_isa_is_forced():
    """Inductor's own config.patch: monkeypatch's undo on the config's ``cpp`` proxy deleted the key (every later
    Inductor C++ compile in the process then failed: 'config.cpp.vec_isa_ok does not exist')."""
    from torch._inductor import config

    with config.patch({"cpp.vec_isa_ok": False}):
        assert isa_probe.candidates() == []
    assert config.cpp.vec_isa_ok is None


def test_only_models_with_cpu_tensors_count_as_on_the_cpu():
    assert api._on_cpu(nn.Linear(2, 2))
    assert api._on_cpu(nn.ReLU())  # no tensors: its inputs decide, and they may be on the CPU
    assert not api._on_cpu(nn.Linear(2, 2, device="meta"))
    mixed = nn.Sequential(nn.Linear(2, 2, device="meta"), nn.Linear(2, 2))
    assert api._on_cpu(mixed)
