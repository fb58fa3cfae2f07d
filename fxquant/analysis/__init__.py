"""fxquant.analysis: statistics, plots and a browsable report over capture sets and training runs (issue 6).

    >>> from fxquant import analysis
    >>> res = analysis.report(["captures/run1"], "report/", workers=4)   # or: fxquant report DIR --out OUT -j 4
    >>> res.index                                                        # report/index.html

The work streams over the capture set (engine.py: a process pool, tqdm progress, summaries merged in
a fixed order); tensors are reduced to fixed-bin histograms and moments (bins.py, moments.py) and never
held together in memory. See docs/analysis.md for every output and the accuracy of each number.
"""
from __future__ import annotations

from fxquant.analysis.loss_curves import Run, load_run, mean_relative_error
from fxquant.analysis.mx_study import quantize_with_offset
from fxquant.analysis.report import DEFAULT_FORMATS, DEFAULT_MX, ReportResult, report
from fxquant.analysis.summary import AnalysisConfig

__all__ = ["AnalysisConfig", "DEFAULT_FORMATS", "DEFAULT_MX", "ReportResult", "Run", "load_run",
           "mean_relative_error", "quantize_with_offset", "report"]
