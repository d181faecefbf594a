"""KV codecs: TurboQuant (rotation + Lloyd-Max codebooks + bit packing) and MLX affine."""

from tqserve.engine.codec.affine import AffineCodec, AffineEncoded
from tqserve.engine.codec.turboquant import EncodedVectors, TurboQuantCodec

__all__ = ["AffineCodec", "AffineEncoded", "EncodedVectors", "TurboQuantCodec"]
