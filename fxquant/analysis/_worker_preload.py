"""Imported once by the analysis process pool's forkserver, before any worker forks: loads
fxquant.kernels.host's compiled kernels (numba's on-disk cache, or a first compile) and matplotlib's Agg
backend, so every worker starts with them (workers summarise tensors, then render figures)."""
from fxquant.analysis.outputs import pyplot
from fxquant.kernels import host

host.warm_up()
pyplot()
