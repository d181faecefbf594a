"""AffineCodec: shapes, round-trip error against each group's scale, argument checks."""

import mlx.core as mx
import numpy as np
import pytest

from tqserve.engine.codec.affine import AffineCodec


def _vectors(num: int, head_dim: int = 128) -> mx.array:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((num, head_dim)) * rng.uniform(0.01, 100.0, (num, 1))
    return mx.array((x + rng.uniform(-50.0, 50.0, (num, 1))).astype(np.float32))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_shapes_follow_leading_axes(bits: int, group_size: int) -> None:
    codec = AffineCodec(bits, group_size)
    x = mx.random.normal((2, 3, 5, 128), key=mx.random.key(1))
    encoded = codec.encode(x)
    assert encoded.wq.shape == (2, 3, 5, 128 * bits // 32)
    assert encoded.wq.dtype == mx.uint32
    assert encoded.scales.shape == (2, 3, 5, 128 // group_size)
    assert encoded.biases.shape == (2, 3, 5, 128 // group_size)
    assert codec.decode(encoded).shape == (2, 3, 5, 128)
    assert codec.decode(codec.encode(x[0, 0, 0])).shape == (128,)
    assert codec.decode(codec.encode(x[:, :0])).shape == (2, 0, 5, 128)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_round_trip_error_within_one_step(bits: int, group_size: int) -> None:
    codec = AffineCodec(bits, group_size)
    x = _vectors(2000)
    encoded = codec.encode(x)
    wq, scales, biases = encoded
    assert wq is encoded.wq and scales is encoded.scales and biases is encoded.biases
    error = mx.abs(x - codec.decode(encoded)).reshape(2000, 128 // group_size, group_size)
    steps = np.array(error / mx.abs(scales)[..., None])
    assert steps.max() <= 1.0001
    assert 0.2 < steps.mean() < 0.3


def test_eight_bits_beats_four_bits() -> None:
    x = _vectors(500)
    errors = {
        bits: mx.mean(mx.square(x - AffineCodec(bits, 64).decode(AffineCodec(bits, 64).encode(x))))
        for bits in (4, 8)
    }
    assert errors[8].item() < errors[4].item() / 200


def test_decode_dtype() -> None:
    codec = AffineCodec(8, 32)
    x = mx.random.normal((4, 64), key=mx.random.key(2))
    assert codec.decode(codec.encode(x)).dtype == mx.float32
    assert codec.decode(codec.encode(x), mx.bfloat16).dtype == mx.bfloat16


@pytest.mark.parametrize("bits", [2, 3, 16])
def test_bad_bits(bits: int) -> None:
    with pytest.raises(ValueError, match=f"bits {bits} "):
        AffineCodec(bits, 64)


@pytest.mark.parametrize("group_size", [16, 128])
def test_bad_group_size(group_size: int) -> None:
    with pytest.raises(ValueError, match=f"group_size {group_size} "):
        AffineCodec(4, group_size)


def test_head_dim_not_multiple_of_group() -> None:
    with pytest.raises(ValueError, match="group_size 64"):
        AffineCodec(4, 64).encode(mx.zeros((3, 96)))
