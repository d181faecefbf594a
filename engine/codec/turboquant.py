"""TurboQuant KV codec, MSE-optimal variant (arXiv 2504.19874).

Per vector x of dim d: store ||x|| as fp16 and, for u = x / ||x||, the b-bit indices of the
nearest Lloyd-Max centroid of each coordinate of y = R u, bit-packed densely into uint32
words. R is a fixed random orthogonal rotation from a seed, so each coordinate of y follows
the exact marginal of a uniform point on the unit sphere, f(t) ~ (1 - t^2)^((d-3)/2), and
the codebook is Lloyd-Max for that density.

Rotation choice, from `tools/codec_rotation.py` on pycoder-29m: real K and V of 512 tokens
of mlx_lm/generate.py (16,384 vectors, d=128), float32, MLX CPU backend, 2 cores. Relative
MSE is mean ||x - x^||^2 / ||x||^2 (the paper's D_mse); the codebook expects 0.0340 at 3
bits and 0.0093 at 4. Speed is encode+decode vectors/s at 3 bits (4 bits within 10%), with
MLX's bundled reference BLAS / with OpenBLAS preloaded (one run; speeds vary ~20% between
runs on this shared machine); a token is 32 vectors here.

    rotation   K 3-bit  K 4-bit  V 3-bit  V 4-bit  vectors/s (reference / OpenBLAS)
    qr         0.0341   0.0093   0.0337   0.0092    47k / 150k
    hadamard   0.0336   0.0092   0.0339   0.0093   126k / 161k

Quality is the same for both and matches random unit vectors. The randomized Hadamard
transform is O(d log d), needs no d x d matrix and is never slower, so it is the default.

Norm correction (`norm_correction=True`, what the KV caches use): the stored norm is
||x|| / ||c^|| where c^ is the quantized unit direction, so every reconstruction has
exactly the input's length. Plain Lloyd-Max reconstructions are shorter on average
(E||c^||^2 = 1 - D), which shrinks every attention score by about D. Corrected, the MSE
is 2 - 2||c^|| ~ D + D^2/4 (0.0093 -> 0.0093 at 4 bits; 0.36 -> 0.40 at 1 bit), and on
pycoder-29m (tools/eval_kv, 512-token context) mean next-token KL against the plain cache
fell from 8.6e-3 to 4.1e-3 at k4v4 and from 3.4e-2 to 1.7e-2 at k3v3. The paper's
distortion table is for the plain quantizer (the default here).

Norms: computed after scaling by the max |x_i|, so tiny (1e-30) and huge (1e30) fp32 inputs
neither underflow nor overflow. Stored norms saturate at fp16's largest finite value (65504):
a vector with a larger norm decodes with norm 65504 in its own direction. Norms below fp16's
smallest subnormal (~6e-8) are stored as 0 and such vectors decode to exactly zero, as do
zero vectors. Inputs must be finite.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, NamedTuple

import attrs
import mlx.core as mx
import numpy as np

SUPPORTED_HEAD_DIMS = (64, 128, 256, 512)
MIN_BITS = 1
MAX_BITS = 8
ROTATIONS = ("qr", "hadamard")
DEFAULT_ROTATION = "hadamard"
FP16_MAX = 65504.0

# Grid for the marginal's cumulative integrals: spacing 1.5e-5, ~2,900 points per standard
# deviation even at d=512, so trapezoid and interpolation errors stay below 1e-9.
_GRID_INTERVALS = 1 << 17
# Newton on the Lloyd-Max fixed point converges in <10 steps; 1e-10 sits above the ~1e-12
# float64 noise floor of the cumulative sums.
_SOLVE_TOL = 1e-10
_SOLVE_MAX_ITER = 50


@attrs.frozen(eq=False)
class Codebook:
    """Lloyd-Max quantizer for one coordinate of a uniform unit vector in R^head_dim."""

    centroids: np.ndarray  # float64, (2**bits,), ascending, symmetric about 0
    boundaries: np.ndarray  # float64, (2**bits - 1,), midpoints between centroids
    distortion: float  # expected ||u - u^||^2 for a unit vector u (head_dim * per-coord MSE)


class EncodedVectors(NamedTuple):
    """Encoded vectors; a tuple, so `mx.eval(encoded)` evaluates both planes."""

    codes: mx.array  # uint32, (..., head_dim * bits // 32)
    norms: mx.array  # float16, (..., 1)


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")


def _check_bits(bits: int) -> None:
    if bits not in range(MIN_BITS, MAX_BITS + 1):
        raise ValueError(f"bits {bits} is not supported; use {MIN_BITS}..{MAX_BITS}")


@functools.cache
def _marginal_tables(head_dim: int) -> tuple[np.ndarray, ...]:
    """Grid t on [-1, 1], density f, and cumulative integrals of f, t f, t^2 f, f^(1/3)."""
    t = np.linspace(-1.0, 1.0, _GRID_INTERVALS + 1)
    dt = t[1] - t[0]
    with np.errstate(divide="ignore"):
        log_f = 0.5 * (head_dim - 3) * np.log(np.maximum(1.0 - t * t, 0.0))
    f = np.exp(log_f - log_f.max())

    def cumulative(g: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum((g[1:] + g[:-1]) * (0.5 * dt))])

    f /= cumulative(f)[-1]
    return t, f, cumulative(f), cumulative(t * f), cumulative(t * t * f), cumulative(np.cbrt(f))


@functools.cache
def lloyd_max_codebook(head_dim: int, bits: int) -> Codebook:
    """Solve the Lloyd-Max codebook for the exact coordinate marginal at head_dim.

    Starts from the Panter-Dite point density (f^(1/3)) and applies Newton's method to the
    Lloyd fixed point (centroid = conditional mean of its cell, boundaries = midpoints),
    whose Jacobian is tridiagonal; a Newton step that would unorder the centroids falls back
    to a plain Lloyd step.
    """
    _check_head_dim(head_dim)
    _check_bits(bits)
    t, f, mass_cdf, mean_cdf, square_cdf, compander = _marginal_tables(head_dim)
    levels = 1 << bits
    c = np.interp((np.arange(levels) + 0.5) / levels, compander / compander[-1], t)
    rows = np.arange(levels)
    for _ in range(_SOLVE_MAX_ITER):
        b = np.concatenate([[-1.0], 0.5 * (c[1:] + c[:-1]), [1.0]])
        mass = np.diff(np.interp(b, t, mass_cdf))
        mu = np.diff(np.interp(b, t, mean_cdf)) / mass
        f_b = np.interp(b, t, f)
        d_lo = f_b[:-1] * (mu - b[:-1]) / mass  # d mu_i / d (lower boundary of cell i)
        d_hi = f_b[1:] * (b[1:] - mu) / mass  # d mu_i / d (upper boundary of cell i)
        jacobian = np.eye(levels)
        jacobian[rows[1:], rows[1:]] -= 0.5 * d_lo[1:]
        jacobian[rows[1:], rows[:-1]] -= 0.5 * d_lo[1:]
        jacobian[rows[:-1], rows[:-1]] -= 0.5 * d_hi[:-1]
        jacobian[rows[:-1], rows[1:]] -= 0.5 * d_hi[:-1]
        new = c - np.linalg.solve(jacobian, c - mu)
        if np.any(np.diff(new) <= 0):
            new = mu
        new = 0.5 * (new - new[::-1])
        step = np.max(np.abs(new - c))
        c = new
        if step < _SOLVE_TOL:
            break
    else:
        raise RuntimeError(f"Lloyd-Max did not converge for head_dim {head_dim}, bits {bits}")
    b = np.concatenate([[-1.0], 0.5 * (c[1:] + c[:-1]), [1.0]])
    cell = [np.diff(np.interp(b, t, cdf)) for cdf in (mass_cdf, mean_cdf, square_cdf)]
    distortion = float(np.sum(cell[2] - 2.0 * c * cell[1] + c * c * cell[0])) * head_dim
    c.flags.writeable = False
    boundaries = b[1:-1].copy()
    boundaries.flags.writeable = False
    return Codebook(centroids=c, boundaries=boundaries, distortion=distortion)


def rotation_matrix(head_dim: int, seed: int, rotation: str = DEFAULT_ROTATION) -> np.ndarray:
    """The orthogonal matrix R (float64, d x d) that the codec applies as y = R u.

    "qr": Q of a seeded Gaussian matrix, columns sign-corrected by diag(R) so Q is Haar.
    "hadamard": H D with H the normalized Sylvester Walsh-Hadamard matrix and D a seeded
    random +-1 diagonal.
    """
    _check_head_dim(head_dim)
    if rotation == "qr":
        gaussian = np.random.default_rng(seed).standard_normal((head_dim, head_dim))
        q, r = np.linalg.qr(gaussian)
        return q * np.sign(np.diag(r))
    if rotation == "hadamard":
        h = np.ones((1, 1))
        while h.shape[0] < head_dim:
            h = np.block([[h, h], [h, -h]])
        hadamard: np.ndarray = h / math.sqrt(head_dim) * _hadamard_signs(head_dim, seed)
        return hadamard
    raise ValueError(f"rotation {rotation!r} is not supported; use one of {ROTATIONS}")


def _hadamard_signs(head_dim: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2, head_dim) * 2.0 - 1.0


def _bucket_table(boundaries: np.ndarray) -> tuple[float, float, np.ndarray]:
    """Uniform buckets at most half as wide as the narrowest cell, each with the count of
    boundaries at or below its start: a value's index is that count plus one comparison
    with the next boundary (at most one boundary lies inside a bucket). Two gathers per
    value at any bit width, against 2^bits - 1 comparisons or `bits` dependent gathers."""
    edges = np.concatenate([[-1.0], boundaries, [1.0]])
    width = 0.5 * float(np.min(np.diff(edges)))
    origin = float(boundaries[0]) - width
    num_buckets = math.ceil((float(boundaries[-1]) - origin) / width) + 2
    starts = origin + width * np.arange(num_buckets)
    return origin, width, np.searchsorted(boundaries, starts, side="right")


def _hadamard(x: mx.array) -> mx.array:
    """Normalized Walsh-Hadamard transform of the last axis (H is symmetric: x @ H)."""
    return mx.hadamard_transform(x) if x.size else x  # it refuses empty arrays


def _check_packing(n: int, bits: int) -> None:
    if bits not in range(MIN_BITS, MAX_BITS + 1) or n % 8 or (n * bits) % 32:
        raise ValueError(
            f"cannot pack {n} codes of {bits} bits: need bits in {MIN_BITS}..{MAX_BITS}, "
            "n a multiple of 8 and n * bits a multiple of 32"
        )


def pack_bits(codes: mx.array, bits: int) -> mx.array:
    """Pack the low `bits` bits of (..., n) codes densely into (..., n * bits // 32) uint32.

    Code i occupies bits [i*bits, (i+1)*bits) of the little-endian bit stream, so codes
    straddle word boundaries (3 bits: 32 codes -> 3 words). Each 8 codes form one uint64
    whose low `bits` bytes are consecutive bytes of the stream; the words are a view of
    those bytes (MLX runs on little-endian hosts and GPUs only).
    """
    n = codes.shape[-1]
    _check_packing(n, bits)
    lead = codes.shape[:-1]
    octets = (codes.astype(mx.uint64) & ((1 << bits) - 1)).reshape(*lead, n // 8, 8)
    chunks = mx.sum(octets << (mx.arange(8, dtype=mx.uint64) * bits), axis=-1)
    stream = chunks.view(mx.uint8).reshape(*lead, n // 8, 8)[..., :bits]
    return mx.contiguous(stream).reshape(*lead, n * bits // 8).view(mx.uint32)


def unpack_bits(words: mx.array, bits: int, n: int) -> mx.array:
    """Inverse of `pack_bits`: (..., n * bits // 32) uint32 words -> (..., n) uint32 codes."""
    _check_packing(n, bits)
    if words.dtype != mx.uint32 or words.shape[-1] != n * bits // 32:
        raise ValueError(f"expected (..., {n * bits // 32}) uint32 words, got {words.shape}")
    lead = words.shape[:-1]
    stream = words.view(mx.uint8).reshape(*lead, n // 8, bits)
    padded = mx.pad(stream, [(0, 0)] * len(lead) + [(0, 0), (0, 8 - bits)])
    chunks = padded.reshape(*lead, n).view(mx.uint64)
    codes = (chunks[..., None] >> (mx.arange(8, dtype=mx.uint64) * bits)) & ((1 << bits) - 1)
    return codes.reshape(*lead, n).astype(mx.uint32)


class TurboQuantCodec:
    """Encode/decode (..., head_dim) vectors to b-bit TurboQuant codes plus fp16 norms.

    `rotate`/`unrotate` apply R to row vectors (x @ R^T and y @ R), so
    <rotate(q), rotate(k)> = <q, k>. `encode_rotated`/`decode_rotated` work in the rotated
    basis: decode(e) == unrotate(decode_rotated(e)).
    """

    def __init__(
        self, head_dim: int, bits: int, seed: int = 0, rotation: str = DEFAULT_ROTATION,
        norm_correction: bool = False,
    ) -> None:
        _check_head_dim(head_dim)
        _check_bits(bits)
        self.norm_correction = norm_correction
        if rotation not in ROTATIONS:
            raise ValueError(f"rotation {rotation!r} is not supported; use one of {ROTATIONS}")
        self.head_dim = head_dim
        self.bits = bits
        self.seed = seed
        self.rotation = rotation
        self.codebook = lloyd_max_codebook(head_dim, bits)
        self._centroids = mx.array(self.codebook.centroids, dtype=mx.float32)
        self._bucket_origin, self._bucket_width, table = _bucket_table(self.codebook.boundaries)
        self._bucket_table = mx.array(table, dtype=mx.uint32)
        upper = np.append(self.codebook.boundaries, np.inf)
        self._upper_boundaries = mx.array(upper, dtype=mx.float32)
        if rotation == "hadamard":
            self._signs = mx.array(_hadamard_signs(head_dim, seed), dtype=mx.float32)
        else:
            matrix = rotation_matrix(head_dim, seed, rotation)
            self._matrix_t = mx.array(matrix.T, dtype=mx.float32)
            self._matrix = mx.array(matrix, dtype=mx.float32)

    @property
    def hadamard_signs(self) -> mx.array | None:
        """The +-1 diagonal D of a "hadamard" rotation R = H D (float32), else None."""
        return self._signs if self.rotation == "hadamard" else None

    @property
    def num_code_words(self) -> int:
        """uint32 words of codes per vector."""
        return self.head_dim * self.bits // 32

    def rotate(self, x: mx.array) -> mx.array:
        """x @ R^T over the last axis, computed in float32, returned in x's dtype."""
        x32 = self._check_shape(x).astype(mx.float32)
        if self.rotation == "qr":
            return (x32 @ self._matrix_t).astype(x.dtype)
        return _hadamard(x32 * self._signs).astype(x.dtype)

    def unrotate(self, y: mx.array) -> mx.array:
        """y @ R over the last axis (the inverse of `rotate`), returned in y's dtype."""
        y32 = self._check_shape(y).astype(mx.float32)
        if self.rotation == "qr":
            return (y32 @ self._matrix).astype(y.dtype)
        return (_hadamard(y32) * self._signs).astype(y.dtype)

    def encode(self, x: mx.array) -> EncodedVectors:
        """Encode (..., head_dim) vectors: one compiled graph (normalize, rotate, quantize,
        pack), so a decode step costs a few kernel launches per layer, not dozens."""
        codes, norms = self._compiled_encode(self._check_shape(x))
        return EncodedVectors(codes=codes, norms=norms)

    @functools.cached_property
    def _compiled_encode(self) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
        def encode(x: mx.array) -> tuple[mx.array, mx.array]:
            unit, norms = self._normalize(x)
            return tuple(self._quantize(self.rotate(unit), norms))  # type: ignore[return-value]

        return mx.compile(encode)

    def encode_rotated(self, y: mx.array) -> EncodedVectors:
        """Encode vectors already in the rotated basis (y = rotate(x))."""
        unit, norms = self._normalize(y)
        return self._quantize(unit, norms)

    def decode_rotated(self, encoded: EncodedVectors, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Decode without the inverse rotation: norm * centroids, in the rotated basis."""
        indices = unpack_bits(encoded.codes, self.bits, self.head_dim)
        values = self._centroids[indices] * encoded.norms.astype(mx.float32)
        return values.astype(dtype)

    def decode(self, encoded: EncodedVectors, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Decode to (..., head_dim) vectors in the original basis."""
        return self.unrotate(self.decode_rotated(encoded)).astype(dtype)

    def _check_shape(self, x: mx.array) -> mx.array:
        if x.ndim == 0 or x.shape[-1] != self.head_dim:
            raise ValueError(f"expected (..., {self.head_dim}) vectors, got shape {x.shape}")
        return x

    def _normalize(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Unit vectors (zero rows stay zero) and float32 norms (..., 1), over/underflow-safe."""
        x32 = self._check_shape(x).astype(mx.float32)
        scale = mx.max(mx.abs(x32), axis=-1, keepdims=True)
        scaled = x32 / mx.where(scale > 0, scale, 1.0)
        scaled_norm = mx.linalg.norm(scaled, axis=-1, keepdims=True)
        unit = scaled / mx.where(scaled_norm > 0, scaled_norm, 1.0)
        return unit, scale * scaled_norm

    def _quantize(self, unit: mx.array, norms: mx.array) -> EncodedVectors:
        """Nearest-centroid indices via the bucket table, then pack; norms saturate to fp16."""
        last_bucket = self._bucket_table.size - 1
        bucket = mx.floor((unit - self._bucket_origin) / self._bucket_width)
        below = self._bucket_table[mx.clip(bucket, 0, last_bucket).astype(mx.uint32)]
        indices = below + (unit > self._upper_boundaries[below]).astype(mx.uint32)
        if self.norm_correction:
            recon = mx.linalg.norm(self._centroids[indices], axis=-1, keepdims=True)
            norms = norms / mx.where(recon > 0, recon, 1.0)
        stored = mx.minimum(norms, FP16_MAX).astype(mx.float16)
        return EncodedVectors(codes=pack_bits(indices, self.bits), norms=stored)
