"""Imported once by the analysis process pool's forkserver, before any worker forks: loads
fxquant.kernels.host's compiled kernels (numba's on-disk cache, or a first compile), so every worker
starts with them. matplotlib (only its colour maps, for the SVG figures) is left to the first figure job
that needs one: a tables-only report never imports it."""
from fxquant.kernels import host

host.warm_up()
