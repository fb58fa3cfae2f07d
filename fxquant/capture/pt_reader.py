"""Reading the predecessor's ``.pt`` captures as a capture set (PREDECESSOR.md "Tensor capture").

A directory tree of ``.pt`` files, each ``{"tensor", "tensor_info", "metadata"}`` as the predecessor's
tensor saver (or ``fxquant capture export-pt``) wrote it, opens as a ``PtCaptureSet``: the same records,
``query``, ``load`` and ``verify`` as an fxquant capture set, so ``fxquant report``, ``quant-error`` and
``mx-sweep`` compare old NPU/GPU runs with new ones. ``fxquant.capture.open(dir)`` picks this reader when
the directory holds no ``rank-NNNNN`` directories but does hold ``.pt`` files.

Files are read with ``torch.load(weights_only=True)`` (memory-mapped where the file is a zip archive):
plain tensors, numbers, strings, lists and dicts only; a file carrying pickled objects or code is refused
and listed in ``problems``, never executed. Metadata become record fields:

    scheme      metadata.quant_type, else the file's directory name (the predecessor's {save_dir}/{quant_type}/)
    component   attention if metadata.component == "FA" or layer_type == "attention", else linear
    role        metadata.tensor_name; a linear's backward "input" becomes grad_output (the predecessor saved
                the incoming gradient under that name); ``<role>_quantized_<gemm>`` (export-pt) a quantized copy
    direction   metadata.operation (forward | backward);  phase: metadata.phase (pre | post), if recorded
    layer, rank, iteration, micro_batch
                metadata.layer_idx / rank / iteration / micro_batch, else ``L<n>``, ``rank<n>``, ``iter<n>`` in
                the file name, else None / 0
    module      extras.module (export-pt), else ``<layer_type>.L<layer>``
    kind        layer_type of an export-pt file (the capture record's kind: fc1, qkv, ...), else attention for
                attention and None
    sample, section, stats
                extras.sample / section / stats (export-pt: the capture record's), else None; a sampled tensor's
                ``shape`` is tensor_info.shape (the whole tensor's), its ``stored_shape`` the rows the file holds
    predecessor_name   the file's tensor_name as written
The file's tensor must be a floating tensor; anything else is listed in ``problems``.
"""
from __future__ import annotations

import logging
import pickle
import re
import zipfile
from pathlib import Path

import torch

from fxquant.capture.reader import CaptureReadError, CaptureSet, Record, _Handles

log = logging.getLogger(__name__)

KEY = "tensor"
_NUM = {name: re.compile(rf"(?:^|_){name}(\d+)(?:_|$)") for name in ("iter", "rank", "L")}
_ROLE_ALIASES = {("linear", "backward", "input"): "grad_output"}


def has_pt_files(root: Path) -> bool:
    return next(Path(root).rglob("*.pt"), None) is not None


def load_pt(path: str | Path, mmap: bool = True) -> dict:
    """One ``.pt`` payload, safely: ``weights_only=True``; memory-mapped when the file is a zip archive."""
    path = Path(path)
    use_mmap = mmap and zipfile.is_zipfile(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True, mmap=use_mmap)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CaptureReadError(f"{path}: refused: not loadable with weights_only=True (pickled objects or code): "
                               f"{first}") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CaptureReadError(f"{path}: cannot be read as a .pt file: {exc}") from None
    if isinstance(data, torch.Tensor):
        data = {KEY: data}
    if not isinstance(data, dict) or not isinstance(data.get(KEY), torch.Tensor):
        raise CaptureReadError(f"{path}: expected a dict with a 'tensor' entry (the predecessor's payload), "
                               f"got {type(data).__name__}")
    return data


def _from_name(stem: str, name: str) -> int | None:
    m = _NUM[name].search(stem)
    return int(m.group(1)) if m else None


def _int(value, default=None):
    if isinstance(value, bool):
        return default
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.lstrip("-").isdigit():
        return int(value)
    return default


def _kind(layer_type: str, component: str, extras: dict) -> str | None:
    """The record's site kind: an export-pt file's layer_type (the capture record's kind, e.g. fc1), else
    attention for attention and None for the predecessor's own linear files."""
    from fxquant.capture.spec import ModuleKind

    if "module" in extras and layer_type in {k.value for k in ModuleKind} and (
            ModuleKind(layer_type).component.value == component):
        return layer_type
    return "attention" if component == "attention" else None


def fields_of(path: Path, data: dict, seq: int, scheme_default: str) -> dict:
    """The fxquant record fields of one payload (module docstring)."""
    meta = data.get("metadata") if isinstance(data.get("metadata"), dict) else {}
    extras = meta.get("extras") if isinstance(meta.get("extras"), dict) else {}
    t: torch.Tensor = data[KEY]
    if not t.is_floating_point():
        raise CaptureReadError(f"{path}: its tensor has dtype {t.dtype}; only floating tensors are analysed")
    stem = path.stem
    layer_type = str(meta.get("layer_type") or ("attention" if "_FA_" in stem or "attention" in stem else "linear"))
    component = "attention" if meta.get("component") == "FA" or layer_type == "attention" else "linear"
    direction = meta.get("operation") if meta.get("operation") in ("forward", "backward") else (
        "backward" if "_backward_" in stem else "forward")
    name = str(meta.get("tensor_name") or stem.rsplit("_", 1)[-1])
    copy, gemm = (extras.get("copy") or "hp"), extras.get("gemm")
    role = name
    if "_quantized_" in name:
        role, _, g = name.partition("_quantized_")
        copy, gemm = "quantized", gemm or g or None
    role = _ROLE_ALIASES.get((component, direction, role), role)
    layer = _int(meta.get("layer_idx"), _from_name(stem, "L"))
    phase = meta.get("phase") if meta.get("phase") in ("pre", "post") else None
    scheme = str(meta.get("quant_type") or scheme_default)
    sample = extras.get("sample") if isinstance(extras.get("sample"), dict) else None
    info = data.get("tensor_info") if isinstance(data.get("tensor_info"), dict) else {}
    full = info.get("shape")
    # a sampled tensor (export-pt of a `sampling:` section) holds some rows of the shape its tensor_info records
    shape = list(full) if sample is not None and isinstance(full, list) and all(
        isinstance(n, int) and not isinstance(n, bool) for n in full) else list(t.shape)
    return {
        "run_id": f"pt:{path.parent}", "scheme": scheme, "rank": _int(meta.get("rank"), _from_name(stem, "rank")) or 0,
        "format": extras.get("format") if copy == "quantized" else None,
        "qspec": extras.get("qspec") if copy == "quantized" else None, "component": component,
        "module": str(extras.get("module") or f"{layer_type}.L{'X' if layer is None else layer}"),
        "kind": _kind(layer_type, component, extras), "layer": layer, "role": role, "copy": copy,
        "gemm": gemm, "phase": phase, "direction": direction,
        "iteration": _int(meta.get("iteration"), _from_name(stem, "iter")) or 0,
        "micro_batch": _int(meta.get("micro_batch"), 0), "seq": seq,
        "section": extras.get("section") if isinstance(extras.get("section"), str) else None,
        "shard_dim": extras.get("shard_dim"), "blocked_dim": extras.get("blocked_dim") if copy == "quantized" else None,
        "shape": shape, "stored_shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
        "sample": sample, "stats": extras.get("stats") if isinstance(extras.get("stats"), dict) else None,
        "key": KEY, "file": path.name, "checksum": None, "time": path.stat().st_mtime,
        "predecessor_name": name, "source": "pt",
        **{k: extras[k] for k in ("tp_rank", "tp_size", "pp_rank", "pp_size", "dp_rank", "dp_size")
           if k in extras},
    }


class PtCaptureSet(CaptureSet):
    """The ``.pt`` files under ``root`` as capture records (indexed on first use, so opening is cheap)."""

    def __init__(self, root: str | Path, records: list[Record] | None = None, _meta: dict | None = None,
                 _handles: _Handles | None = None):
        self.root = Path(root)
        self._handles = _Handles() if _handles is None else _handles
        self.meta = _meta or {}
        self._index = records
        self.problems: list[str] = []
        self.unreadable: dict[str, str] = {}  # no rank directories here (CaptureSet's field)
        if records is None and not self.root.is_dir():
            raise CaptureReadError(f"capture directory {self.root} does not exist")

    @property
    def _records(self) -> list[Record]:
        if self._index is None:
            self._index = []
            for path in sorted(self.root.rglob("*.pt")):
                try:
                    data = load_pt(path)
                    fields = fields_of(path, data, len(self._index), path.parent.name if path.parent != self.root
                                       else "unknown")
                except CaptureReadError as exc:
                    log.info("%s", exc)  # in problems: the caller reports it (the CLIs print each once)
                    self.problems.append(str(exc))
                    continue
                self._index.append(Record(fields, path.parent))
        return self._index

    @_records.setter
    def _records(self, value: list[Record]) -> None:
        self._index = value

    @property
    def committed(self) -> bool:
        return True

    def query(self, **conditions) -> "PtCaptureSet":
        sub = super().query(**conditions)
        out = PtCaptureSet(self.root, sub._records, self.meta, self._handles)
        out.problems = self.problems
        return out

    def load(self, record: Record, *, check: bool = False) -> torch.Tensor:
        """The record's tensor (``check`` has nothing to verify: .pt files carry no checksum)."""
        return load_pt(record.path)[KEY]

    def verify(self) -> list[str]:
        problems = list(self.problems)
        for rec in self._records:
            try:
                self.load(rec)
            except CaptureReadError as exc:
                problems.append(str(exc))
        return problems
