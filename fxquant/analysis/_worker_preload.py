"""Imported once by the analysis process pool's forkserver: loads fxquant.kernels.host's compiled kernels
(numba's on-disk cache, or a first compile) before any worker forks, so every worker starts with them."""
from fxquant.kernels import host

host.warm_up()
