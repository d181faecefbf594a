"""Model math and sans-io cores; the only part that imports MLX.

Importing it first loads the optimized BLAS that TQSERVE_BLAS names (tqserve.blas), while
MLX is not imported yet, so the embedded API runs on the BLAS `serve` uses."""

from tqserve import blas as _blas

_blas.preload()
