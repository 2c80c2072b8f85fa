"""The integer image min/max of floating tensors reduce on Gloo, MPI and NCCL.

Bit-exact round trips, order, and agreement with ``torch.minimum`` /
``torch.maximum`` (the shared-memory plane's reduction) for every floating
dtype; 16-bit dtypes exhaustively, the wider ones on random bit patterns and
the special values.
"""

import pytest
import torch

from hvdlike.core import fusion, nan_order

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


MANTISSA = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23, torch.float64: 52}


def _specials(dtype):
    """Zeros, infinities, extremes, subnormals and NaNs of ``dtype``."""
    info = torch.finfo(dtype)
    values = [0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), info.max, -info.max,
              info.tiny, -info.tiny, info.eps, -info.eps]
    width = torch.iinfo(BITS[dtype]).bits
    mantissa = MANTISSA[dtype]
    exponent = ((1 << (width - 1 - mantissa)) - 1) << mantissa  # all ones
    quiet = 1 << (mantissa - 1)
    sign = -(1 << (width - 1))
    patterns = [
        1, (1 << mantissa) - 1, sign | 1, sign | ((1 << mantissa) - 1),  # subnormals
        exponent | quiet, exponent | quiet | 5, exponent | 1, exponent | 3,  # +NaN
        -1 & ~sign,  # +NaN, every mantissa bit set
        sign | exponent | quiet, sign | exponent | 1,  # -NaN, quiet and signalling
        -1,  # -NaN, every bit set
    ]
    t = torch.tensor(values, dtype=torch.float64).to(dtype)
    return torch.cat([t, torch.tensor(patterns, dtype=torch.int64).to(BITS[dtype]).view(dtype)])


def _patterns(dtype, count=1 << 16, seed=0):
    """Every 16-bit pattern, else ``count`` random ones plus the specials."""
    bits = BITS[dtype]
    if torch.iinfo(bits).bits == 16:
        return torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(bits).view(dtype)
    info = torch.iinfo(bits)
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(info.min, info.max, (count,), dtype=torch.int64, generator=g)
    return torch.cat([raw.to(bits).view(dtype), _specials(dtype)])


def _bits(t):
    return t.view(BITS[t.dtype])


def _plain_nan(dtype):
    return int(torch.tensor(float("nan"), dtype=dtype).view(BITS[dtype]))


def _image(t, maximum):
    """The image of a copy of ``t`` (``t`` is left alone), as int64."""
    return nan_order.to_image(t.clone(), maximum).to(torch.int64)


def _round_trip(t, maximum):
    work = t.clone()
    image = nan_order.to_image(work, maximum)
    nan_order.from_image(image, work, maximum)
    return work


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximum", [False, True])
def test_round_trip_is_bit_exact_and_nan_comes_back_plain(dtype, maximum):
    values = _patterns(dtype)
    back = _round_trip(values, maximum)
    nan = values.isnan()
    assert torch.equal(_bits(back)[~nan], _bits(values)[~nan])
    assert nan.any()
    assert (_bits(back)[nan] == _plain_nan(dtype)).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximum", [False, True])
def test_image_orders_like_the_floats_with_nan_winning(dtype, maximum):
    values = _patterns(dtype)
    nan = values.isnan()
    others = values[~nan]
    images = _image(others, maximum)
    # One image per pattern...
    assert len(torch.unique(images)) == len(torch.unique(_bits(others)))
    # ...and in image order the floats never decrease, -0.0 coming before +0.0.
    order = torch.argsort(images)
    floats = others[order].to(torch.float64)
    assert (floats[1:] >= floats[:-1]).all()
    zeros = floats == 0
    signs = torch.signbit(floats[zeros])
    assert signs.any() and not signs.all()
    assert torch.equal(signs, torch.sort(signs, descending=True).values)
    nan_images = _image(values[nan], maximum)
    assert (nan_images == nan_images[0]).all(), "every NaN has one image"
    if maximum:
        assert nan_images[0] > images.max()
    else:
        assert nan_images[0] < images.min()


def _reduce(parts, maximum):
    """What an engine does: integer max/min of the images, mapped back."""
    images = [nan_order.to_image(p.clone(), maximum) for p in parts]
    result = images[0].clone()
    for image in images[1:]:
        (torch.maximum if maximum else torch.minimum)(result, image, out=result)
    out = torch.empty_like(parts[0])
    first = nan_order.to_image(out, maximum)  # sets up ``out``'s memory as an image
    first.copy_(result)
    nan_order.from_image(first, out, maximum)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximum", [False, True])
def test_integer_min_max_equals_torch_elementwise(dtype, maximum):
    a = _patterns(dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    b = a[torch.randperm(len(a), generator=g)]
    # Also each special against every special.
    s = _specials(dtype)
    a = torch.cat([a, s.repeat_interleave(len(s))])
    b = torch.cat([b, s.repeat(len(s))])
    got = _reduce([a, b], maximum)
    want = (torch.maximum if maximum else torch.minimum)(a, b)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    assert (_bits(got)[nan] == _plain_nan(dtype)).all()
    # Both zeros: torch returns either (by operand order and size); the image
    # returns -0.0 for min and +0.0 for max.
    zeros = (a == 0) & (b == 0) & (_bits(a) != _bits(b))
    assert zeros.any()
    assert (_bits(got)[zeros] == _bits(torch.tensor(0.0 if maximum else -0.0, dtype=dtype))).all()
    rest = ~nan & ~zeros
    assert torch.equal(_bits(got)[rest], _bits(want)[rest])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximum", [False, True])
def test_three_ranks_with_nan_anywhere(dtype, maximum):
    # Rank r holds r - 10; column j has NaN on rank j, the last column none.
    parts = [torch.full((4,), float(r - 10), dtype=dtype) for r in range(3)]
    for j in range(3):
        parts[j][j] = float("nan")
    got = _reduce(parts, maximum)
    assert got[:3].isnan().all()
    assert got[3].item() == (-8.0 if maximum else -10.0)


def test_only_floating_dtypes_are_imaged():
    assert all(nan_order.orders(d) for d in DTYPES)
    for dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
                  torch.complex64, torch.complex128):
        assert not nan_order.orders(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_image_widths(dtype):
    image = nan_order.to_image(torch.ones(3, dtype=dtype), True)
    assert image.dtype == (torch.int32 if torch.finfo(dtype).bits == 16 else BITS[dtype])


class _Group:
    """Stands in for an engine: reduces the image with the other ranks' images."""

    def __init__(self, others, maximum):
        self.others = others
        self.maximum = maximum
        self.seen = []

    def allreduce(self, tensors, opts):
        (image,) = tensors
        self.seen.append(image.dtype)
        group = self

        class Work:
            inline = True
            engine = "TEST"
            phases = ["kept"]
            done = False

            def wait(self, timeout=None):
                if self.done:  # as torch's work objects: the transfer ran once
                    return True
                self.done = True
                for other in group.others:
                    theirs = nan_order.to_image(other.reshape(-1).clone(), group.maximum)
                    (torch.maximum if group.maximum else torch.minimum)(image, theirs,
                                                                       out=image)
                return True

        return Work()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("maximum", [False, True])
def test_allreduce_maps_back_on_wait_and_returns_its_buffers(dtype, maximum):
    mine = torch.tensor([[1.0, float("nan")], [-3.0, 4.0]], dtype=dtype)
    other = torch.tensor([[float("nan"), 2.0], [-1.0, 5.0]], dtype=dtype)
    pool = fusion.BufferPool()
    group = _Group([other], maximum)
    out = mine.clone()
    work = nan_order.allreduce(group, out, None, maximum, pool)
    assert group.seen == [torch.int32 if torch.finfo(dtype).bits == 16 else BITS[dtype]]
    # What the executor reads off a work object passes through.
    assert (work.inline, work.engine, work.phases) == (True, "TEST", ["kept"])
    assert work.wait() is True
    want = (torch.maximum if maximum else torch.minimum)(mine, other)
    assert torch.equal(out.isnan(), want.isnan())
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])
    assert out.dtype == dtype and out.shape == mine.shape
    work.wait()  # maps back once: a second wait changes nothing
    assert torch.equal(out[~want.isnan()], want[~want.isnan()])
    # The scratch (and for 16-bit dtypes the int32 image) went back to the
    # pool: taking them again makes no new buffer.
    made = pool.generation
    assert made > 0
    pool.take(4, BITS[dtype], torch.device("cpu"))
    if torch.finfo(dtype).bits == 16:
        pool.take(4, torch.int32, torch.device("cpu"))
    assert pool.generation == made
