"""What every benchmark's JSON records about its run, under the key ``environment``: the machine (the device
measured and the host CPU with its vector ISA), the software and the command line, so that a result file says
where and how it was measured."""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import torch

CPU_ISA = (("avx2", "AVX2"), ("avx512f", "AVX-512"), ("avx512_bf16", "AVX512-BF16"), ("amx_tile", "AMX"))


def device_name(device: torch.device) -> str:
    """A GPU's name; a CPU's model, torch's thread count and its widest vector ISA (from /proc/cpuinfo)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    isa: list[str] = []
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), model)
        flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
        # The vector ISA says more about a CPU kernel's speed than a virtual machine's model name does.
        isa = [name for flag, name in CPU_ISA if flag in flags]
        if "AVX-512" in isa and "AVX2" in isa:
            isa.remove("AVX2")
    return f"{model} ({', '.join([f'{torch.get_num_threads()} threads', *isa])})"


def parse_device(parser: argparse.ArgumentParser, text: str) -> torch.device:
    """``--device TEXT`` as a torch device, or the parser's one-line error (not a device; CUDA where none is)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        parser.error(f"--device: {text!r} is not a torch device (cpu, cuda, cuda:1, ...)")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: {text!r}, but torch finds no CUDA device here")
    return device


def environment(device: torch.device | str | None = None, argv: list[str] | None = None) -> dict:
    """``device``: the measured device's name (``device_name``; default the CPU); ``device_type``; ``host``: this
    machine's CPU, named the same way (on a CPU run the same as ``device``); ``cpus``, ``torch``, ``python``, the
    UTC ``date``; ``argv``: the script's arguments (``sys.argv[1:]`` unless given, as when ``main(argv)`` is
    called)."""
    dev = torch.device(device if device is not None else "cpu")
    host = device_name(torch.device("cpu"))
    return {"device": host if dev.type == "cpu" else device_name(dev), "device_type": dev.type, "host": host,
            "cpus": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "argv": list(sys.argv[1:] if argv is None else argv)}
