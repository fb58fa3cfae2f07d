"""A training run as one frozen value: `RunConfig` (model, data, training, scheme, layout) and its JSON form.

Also the run's parts: `ParallelLayout`, `DataKind`/`DataConfig`, `OptimConfig`, `TrainConfig`,
`CaptureConfig` (tensor capture during training; `capture_from_args` maps `--capture` and the
predecessor's `--save-tensors` / `--tensor-save-dir` / `--control-iter` / `TENSOR_SAVE_*` to it).

The launcher (`experiments/`) resolves a run, writes `RunConfig.to_dict()` as JSON, and starts
`torchrun ... -m fxquant.megatron_glue.launch --config FILE`, which reads it back with
`RunConfig.from_dict`. No Megatron import here (dry runs validate without building anything).
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxquant.lowering import Kernels
from fxquant.megatron_glue.config import AttentionKind, ModelConfig
from fxquant.megatron_glue.sentinel import NonFinitePolicy


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor-, pipeline- and expert-parallel sizes; data parallelism is world_size / (tp * pp)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ParallelLayout.{name} must be an int >= 1, got {value!r}")

    def data_parallel_size(self, world_size: int) -> int:
        model = self.tp * self.pp
        if world_size % model:
            raise ValueError(f"world size {world_size} is not divisible by tp*pp = {self.tp}*{self.pp}")
        dp = world_size // model
        if dp % self.ep and self.ep > 1:
            raise ValueError(f"ep={self.ep} must divide the data-parallel size {dp}")
        return dp


class DataKind(enum.Enum):
    MOCK = "mock"        # Megatron's MockGPTDataset: synthetic tokens, no files
    INDEXED = "indexed"  # Megatron indexed datasets (.bin/.idx prefixes)


@dataclass(frozen=True)
class DataConfig:
    """What to train on: Megatron's mock dataset, or indexed-dataset prefixes split train/valid/test."""

    kind: DataKind = DataKind.MOCK
    prefixes: tuple[str, ...] = ()
    split: str = "98,2,0"
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.kind is DataKind.INDEXED:
            if not self.prefixes:
                raise ValueError("DataConfig(kind=indexed) needs at least one dataset prefix")
            for prefix in self.prefixes:
                missing = [s for s in (".bin", ".idx") if not Path(f"{prefix}{s}").is_file()]
                if missing:
                    raise FileNotFoundError(f"indexed dataset {prefix!r} is missing {missing}; build it with "
                                            f"`fxquant prepare-data`")


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup_iters: int = 0
    decay_iters: int | None = None  # None = train_iters
    decay_style: str = "cosine"     # cosine | linear | constant (Megatron's names)
    weight_decay: float = 0.1
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed_optimizer: bool = False

    def __post_init__(self) -> None:
        if self.decay_style not in ("cosine", "linear", "constant"):
            raise ValueError(f"decay_style={self.decay_style!r}; allowed: 'cosine', 'linear', 'constant'")
        if not self.lr > 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, min_lr={self.min_lr}")
        if self.warmup_iters < 0 or self.clip_grad < 0:
            raise ValueError(f"warmup_iters and clip_grad must be >= 0, got {self.warmup_iters}, {self.clip_grad}")


def warmup_for(optim: OptimConfig, train_iters: int) -> int:
    """The warm-up a run of `train_iters` iterations uses: `optim.warmup_iters`, clipped to `train_iters - 1`
    (Megatron's scheduler trains iteration 1 at lr 0 during warm-up; a warm-up as long as the run never
    reaches the peak lr)."""
    return max(0, min(optim.warmup_iters, train_iters - 1))


class CompileBackend(enum.Enum):
    INDUCTOR = "inductor"
    AOT_EAGER = "aot_eager"
    EAGER = "eager"  # fxquant's rewritten graph, interpreted
    NONE = "none"    # no torch.compile at all (bf16 only)


class Precision(enum.Enum):
    AUTO = "auto"  # bf16 on CUDA, fp32 elsewhere
    FP32 = "fp32"
    BF16 = "bf16"


@dataclass(frozen=True)
class TrainConfig:
    seq_length: int = 128
    micro_batch_size: int = 2
    global_batch_size: int = 8
    train_iters: int = 50
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: Precision = Precision.AUTO
    save_interval: int = 0  # 0 = no checkpoints
    seed: int = 1234
    control_iter: int | None = None  # stop after this many iterations of this run (predecessor's --control-iter)
    eval_interval: int = 0  # validation loss every N iterations and at the end; 0 = never
    eval_iters: int = 1     # global batches of the validation split per evaluation (the same ones each time)
    nonfinite: NonFinitePolicy = NonFinitePolicy.RECORD  # NaN/Inf sentinel (sentinel.py): record | fatal | off

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters", "eval_iters"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"global_batch_size={self.global_batch_size} is not a multiple of "
                             f"micro_batch_size={self.micro_batch_size}")
        if self.control_iter is not None and self.control_iter < 1:
            raise ValueError(f"control_iter must be >= 1, got {self.control_iter}")
        if self.save_interval < 0:
            raise ValueError(f"save_interval must be >= 0, got {self.save_interval}")
        if self.eval_interval < 0:
            raise ValueError(f"TrainConfig.eval_interval must be >= 0 (0 = no validation), got {self.eval_interval}")

    @property
    def eval_samples(self) -> int:
        """Samples of the validation split one evaluation reads (0 when validation is off)."""
        return self.eval_iters * self.global_batch_size if self.eval_interval else 0

    def last_iteration(self, start: int) -> int:
        """The (1-based) iteration a run starting after `start` completed iterations ends with: `train_iters`, or
        `start + control_iter` where `control_iter` stops it earlier."""
        if self.control_iter is None:
            return self.train_iters
        return min(self.train_iters, start + self.control_iter)

    def evaluates_at(self, iteration: int, start: int = 0) -> bool:
        """Whether the validation loss is computed after `iteration` (1-based) completes, in a run starting after
        `start` completed iterations: every `eval_interval`-th, and the run's last (`last_iteration`)."""
        return bool(self.eval_interval) and (iteration % self.eval_interval == 0
                                             or iteration == self.last_iteration(start))

    def bf16_on(self, device: torch.device) -> bool:
        if self.precision is Precision.AUTO:
            return device.type == "cuda"
        return self.precision is Precision.BF16


DEFAULT_CAPTURE_SUBDIR = "captures"  # under the run directory when CaptureConfig.dir is None


@dataclass(frozen=True)
class CaptureConfig:
    """Tensor capture during training: one `fxquant.capture` session per rank (docs/megatron.md "Capture").

    spec: a shipped spec name (`fxquant.capture.shipped_specs()`) or a spec YAML path.
    dir: the capture root (per-rank subdirectories below it); None: `<run dir>/captures`.
    iterations: the predecessor's `--control-iter N`: every micro-batch of the first N iterations this run
        executes (0: all of them) replaces each section's window; None keeps the spec's own windows.
    micro_batches: the predecessor's `--collect-micro-batches M`: with `iterations`, only micro-batches
        0..M-1 of those iterations.
    """

    spec: str = "predecessor"
    dir: str | None = None
    iterations: int | None = None
    micro_batches: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError(f"CaptureConfig.spec must be a shipped spec name or a YAML path, got {self.spec!r}")
        if self.iterations is not None and (isinstance(self.iterations, bool) or not isinstance(self.iterations, int)
                                            or self.iterations < 0):
            raise ValueError(f"CaptureConfig.iterations must be an integer >= 0 (0: no limit), got {self.iterations!r}")
        if self.micro_batches is not None:
            if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
                raise ValueError(f"CaptureConfig.micro_batches (--collect-micro-batches) must be an integer >= 1, "
                                 f"got {self.micro_batches!r}")
            if self.iterations is None:
                raise ValueError("CaptureConfig.micro_batches (--collect-micro-batches) narrows the predecessor's "
                                 "window: it needs iterations (--save-tensors / --control-iter)")

    def root(self, run_dir: str | Path) -> Path:
        return Path(self.dir) if self.dir is not None else Path(run_dir) / DEFAULT_CAPTURE_SUBDIR


def capture_from_args(args, env: dict | None = None) -> CaptureConfig | None:
    """The run's capture from `--capture SPEC` and the predecessor's flags/environment
    (`fxquant.capture.compat.add_arguments`): `--save-tensors` / `TENSOR_SAVE_ENABLED` turns capture on
    with `SPEC` or the shipped `predecessor` spec, windowed to `--control-iter N` iterations (default 1);
    `--tensor-save-dir` / `TENSOR_SAVE_DIR` is the root (default `./enhanced_tensor_logs`), and
    `--collect-micro-batches M` keeps micro-batches 0..M-1. `--capture` alone keeps the spec's windows and
    writes under the run directory (or `--tensor-save-dir` when given); `--tensor-save-dir` without either
    switch is refused (it was ignored)."""
    from fxquant.capture import compat

    spec = getattr(args, "capture", None)
    micro_batches = getattr(args, "collect_micro_batches", None)
    legacy = compat.from_args(args, env=env)  # validates the flags and env; None when --save-tensors is off
    if legacy is not None:
        n = getattr(args, "control_iter", None)
        return CaptureConfig(spec=spec or "predecessor", dir=str(legacy[1]["root"]), iterations=1 if n is None else n,
                             micro_batches=micro_batches)
    if micro_batches is not None:
        raise ValueError("--collect-micro-batches narrows the predecessor's capture window: it needs --save-tensors "
                         "(or TENSOR_SAVE_ENABLED=1)")
    save_dir = getattr(args, "tensor_save_dir", None)
    if spec is None:
        if save_dir is not None:
            raise ValueError(f"--tensor-save-dir {save_dir!r} says where captures go: it needs --save-tensors (or "
                             "TENSOR_SAVE_ENABLED=1) or --capture SPEC; without them the run captures nothing")
        return None
    return CaptureConfig(spec=spec, dir=save_dir)


def per_run_capture(capture: CaptureConfig | None, subdir: str) -> CaptureConfig | None:
    """An explicit capture root (`--tensor-save-dir` / `TENSOR_SAVE_DIR`) holds one subdirectory per run,
    `ROOT/<subdir>` (the predecessor's `{save_dir}/{quant_type}/`), so runs of several schemes pointed at one
    root keep each other's captures. A capture under the run directory (`dir` None) is already per run."""
    if capture is None or capture.dir is None:
        return capture
    return dataclasses.replace(capture, dir=str(Path(capture.dir) / subdir))


def stop_after(capture: CaptureConfig | None, control_iter: int | None) -> int | None:
    """TrainConfig.control_iter for a command line's `--control-iter` (0: no limit): given, it is used;
    absent, the predecessor's capture (`--save-tensors`, window of N iterations) stops training after N."""
    if control_iter is None and capture is not None:
        control_iter = capture.iterations
    if control_iter is not None and (isinstance(control_iter, bool) or not isinstance(control_iter, int)
                                     or control_iter < 0):
        raise ValueError(f"--control-iter {control_iter!r}: must be an integer >= 0 (0: no limit)")
    return control_iter or None


def check_tensorboard() -> None:
    """TensorBoard output needs torch.utils.tensorboard's writer, i.e. the `tensorboard` package."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the 'tensorboard' package (torch.utils.tensorboard writes its event "
                         "files with it), which is not installed: pip install tensorboard, or drop --tensorboard "
                         "(metrics.jsonl is always written)")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    train: TrainConfig
    data: DataConfig
    output_dir: str
    tokenizer: str = "byte"
    scheme: str = "bf16"          # a preset name, or the name of the scheme in `scheme_yaml`
    scheme_yaml: str | None = None  # the text of a scheme YAML file (`--scheme FILE.yaml`); None: a preset
    capture: CaptureConfig | None = None
    attention: AttentionKind = AttentionKind.SDPA
    backend: CompileBackend = CompileBackend.AOT_EAGER
    kernels: Kernels = Kernels.AUTO  # what the quantize ops run (fxquant.compile(kernels=...), fxquant.lowering)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    resume: bool = True
    tensorboard: bool = False  # TensorBoard event files in <run>/tensorboard (needs the `tensorboard` package)

    def __post_init__(self) -> None:
        if self.tensorboard:
            check_tensorboard()

    def compile_scheme(self):
        """What `fxquant.compile` gets: the preset name, or the Scheme parsed from `scheme_yaml`."""
        if self.scheme_yaml is None:
            return self.scheme
        from fxquant.schemes.yaml_io import load_text

        return load_text(self.scheme_yaml, f"<scheme_yaml of run {self.scheme}>", default_name=self.scheme)

    def to_dict(self) -> dict:
        return _to_plain(self)

    @classmethod
    def from_dict(cls, data: dict) -> "RunConfig":
        return _from_plain(cls, data, "run")


def _to_plain(value):
    if dataclasses.is_dataclass(value):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.init}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [_to_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _to_plain(v) for k, v in value.items()}
    return value


def _type_error(path: str, wanted: str, value) -> TypeError:
    return TypeError(f"{path}: expected {wanted}, got {type(value).__name__} {value!r}")


def _from_plain(tp, value, path: str):
    """``value`` (JSON-like: from a run config file or a ``key=value`` override) as type ``tp``, checked: a value of
    another type is refused naming its dotted path (``"false"`` is no bool, ``6.5`` no int)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return None if value is None else _from_plain(args[0], value, path)
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, "a list", value)
        (item, *_) = typing.get_args(tp)
        return tuple(_from_plain(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in tp)
            raise ValueError(f"{path}: {value!r} is not one of {allowed}") from None
    if tp is bool and not isinstance(value, bool):
        raise _type_error(path, "true or false", value)
    if tp is int and (not isinstance(value, int) or isinstance(value, bool)):
        raise _type_error(path, "an integer", value)
    if tp is float:
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise _type_error(path, "a number", value)
        return float(value)
    if tp in (str, dict) and not isinstance(value, tp):
        raise _type_error(path, "a string" if tp is str else "a mapping", value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise TypeError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        unknown = sorted(set(value) - names)
        if unknown:
            raise ValueError(f"{path}: unknown keys {unknown} for {tp.__name__}; allowed: {sorted(names)}")
        missing = [f.name for f in dataclasses.fields(tp) if f.init and f.name not in value
                   and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
        if missing:
            raise ValueError(f"{path}: missing keys {missing} for {tp.__name__}")
        return tp(**{k: _from_plain(hints[k], v, f"{path}.{k}") for k, v in value.items()})
    return value
