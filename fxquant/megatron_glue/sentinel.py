"""The NaN/Inf sentinel of the training loop: the first iteration, and where, a non-finite value appears.

After every iteration ``NonFiniteSentinel.check`` looks at the loss and the gradient norm (both already
reduced over the job, so every rank decides alike). When either is NaN or Inf it names the places: this rank's
parameters whose gradient (Megatron's ``main_grad`` where present) or value holds a NaN/Inf, in model order
(the first one is ``first_site``). When the run captures tensors with statistics (``what: stats`` or ``both``,
e.g. ``--capture stats_only``), the sentinel also flushes the capture and names the first captured site of
that iteration, in execution order, holding a NaN/Inf (``first_capture_site``: module, role, direction, phase,
micro-batch, NaN and Inf counts), which locates a forward activation. The first such iteration is written to ``nonfinite.json`` in the run
directory (logging rank) and every such iteration gets a ``nonfinite`` entry in its metrics record; with
policy ``fatal`` the run then stops with ``NonFiniteError`` (captures are committed first, as on any error).
Policies (``TrainConfig.nonfinite``, ``--on-nonfinite``): ``record`` (default), ``fatal``, ``off``. Finding the
places costs one pass over the gradients, only on an iteration that already went non-finite.
"""
from __future__ import annotations

import enum
import json
import logging
import math
from pathlib import Path

import torch

log = logging.getLogger(__name__)

REPORT_FILE = "nonfinite.json"
MAX_NAMES = 20  # parameter names listed per kind


class NonFinitePolicy(enum.Enum):
    OFF = "off"
    RECORD = "record"
    FATAL = "fatal"


class NonFiniteError(RuntimeError):
    """The run met a NaN/Inf under ``--on-nonfinite fatal``; ``event`` is what the sentinel recorded."""

    def __init__(self, message: str, event: dict):
        super().__init__(message)
        self.event = event


def _nonfinite(t: torch.Tensor | None) -> bool:
    return t is not None and not bool(torch.isfinite(t).all())


def nonfinite_sites(model: torch.nn.Module) -> dict:
    """This rank's parameters (names, model order) whose gradient or value holds a NaN or Inf."""
    grads, values = [], []
    for name, p in model.named_parameters():
        g = getattr(p, "main_grad", None)
        if _nonfinite(g if g is not None else p.grad):
            grads.append(name)
        if _nonfinite(p.detach()):
            values.append(name)
    return {"grads": grads, "values": values}


def first_capture_site(session, iteration: int) -> dict | None:
    """The first record (capture order) of ``iteration`` (0-based, the session's counter) whose capture statistics
    count a NaN or Inf; flushes the session's writer first. None when none does (or nothing has statistics)."""
    from fxquant.capture import layout
    from fxquant.capture.reader import manifest_records

    session.flush()
    records = manifest_records(session.dir / layout.MANIFEST)
    for r in sorted((r for r in records if r.get("iteration") == iteration), key=lambda r: r.get("seq", 0)):
        st = r.get("stats") or {}
        if st.get("nan_count") or st.get("inf_count"):
            return {k: r.get(k) for k in ("module", "role", "component", "direction", "phase", "copy", "layer",
                                          "micro_batch", "seq")} | {"nan_count": st.get("nan_count"),
                                                                    "inf_count": st.get("inf_count")}
    return None


class NonFiniteSentinel:
    def __init__(self, policy: NonFinitePolicy, run_dir: Path, is_logging_rank: bool, rank: int = 0):
        self.policy, self.path, self.logging, self.rank = policy, Path(run_dir) / REPORT_FILE, is_logging_rank, rank
        self.first: dict | None = None
        self.count = 0

    def resume(self, start_iteration: int, kept: list[dict]) -> None:
        """Go on from a checkpoint at ``start_iteration``: the first event stays the one ``nonfinite.json`` holds
        when it lies at or before the checkpoint, and the occurrences count on from the kept metrics records
        (``kept``: the logging rank's; other ranks count from 0). A report of a later iteration, which this run
        trains again, is removed."""
        self.count = sum(1 for r in kept if r.get("nonfinite"))
        try:
            event = json.loads(self.path.read_text())
        except FileNotFoundError:
            return
        except (json.JSONDecodeError, OSError, UnicodeDecodeError) as exc:
            if self.logging:
                log.warning("%s: unreadable (%s): removed; the next non-finite iteration writes it again", self.path, exc)
            event = None
        if isinstance(event, dict) and isinstance(event.get("iteration"), int) and event["iteration"] <= start_iteration:
            self.first = event
        elif self.logging:
            self.path.unlink(missing_ok=True)

    def check(self, iteration: int, loss: float, grad_norm: float, model: torch.nn.Module,
              capture_session=None) -> dict | None:
        """The event of ``iteration`` (1-based, as in the metrics) when its loss or grad norm is not finite;
        ``capture_session``: the run's CaptureSession, searched for the first non-finite captured site."""
        if self.policy is NonFinitePolicy.OFF:
            return None
        bad = [k for k, v in (("loss", loss), ("grad_norm", grad_norm)) if not math.isfinite(v)]
        if not bad:
            return None
        sites = nonfinite_sites(model)
        self.count += 1
        event = {"iteration": iteration, "in": bad, "loss": repr(float(loss)), "grad_norm": repr(float(grad_norm)),
                 "rank": self.rank, "first_site": (sites["grads"] or sites["values"] or [None])[0],
                 "nonfinite_grads": len(sites["grads"]), "nonfinite_values": len(sites["values"]),
                 "grads": sites["grads"][:MAX_NAMES], "values": sites["values"][:MAX_NAMES],
                 "first_iteration": self.first["iteration"] if self.first else iteration, "occurrences": self.count}
        if capture_session is not None:
            event["first_capture_site"] = first_capture_site(capture_session, iteration - 1)
        if self.first is None:
            self.first = event
            log.error("non-finite %s at iteration %d (first at %s)", " and ".join(bad), iteration,
                      event["first_site"] or "no parameter: the loss itself")
            if self.logging:
                self.path.write_text(json.dumps(event, indent=2) + "\n")
        return event

    def stop_if_fatal(self, event: dict | None) -> None:
        """Under policy ``fatal``, raise ``NonFiniteError`` for ``event`` (after its metrics were written)."""
        if event is not None and self.policy is NonFinitePolicy.FATAL:
            raise NonFiniteError(f"non-finite {' and '.join(event['in'])} at iteration {event['iteration']} (first "
                                 f"site {event['first_site']}); --on-nonfinite fatal stops the run; details in "
                                 f"{self.path}", event)
