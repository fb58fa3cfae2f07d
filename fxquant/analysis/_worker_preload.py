"""Imported once by the analysis process pool's forkserver, before any worker forks: loads
fxquant.kernels.host's compiled kernels (numba's on-disk cache, or a first compile), so every worker
starts with them. matplotlib is left to the workers' first figure job: a tables-only report never
imports it, and the streaming phase does not wait for it."""
from fxquant.kernels import host

host.warm_up()
