"""KV codecs: TurboQuant (rotation + Lloyd-Max codebooks + bit packing) and MLX affine."""

from engine.codec.affine import AffineCodec, AffineEncoded
from engine.codec.turboquant import EncodedVectors, TurboQuantCodec

__all__ = ["AffineCodec", "AffineEncoded", "EncodedVectors", "TurboQuantCodec"]
