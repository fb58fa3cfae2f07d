"""The experiment matrix and launcher: models x datasets x schemes x training configs, on Megatron-core.

`python -m experiments list | run | matrix`. Thin: the catalogue (`catalog`), the command line and the
supervision of torchrun processes (`launcher`); the work is done by `fxquant.megatron_glue`.
"""
