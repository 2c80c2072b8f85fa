"""The Adasum combination rule and its single-process reference."""

import pytest
import torch

from hvdlike.core.adasum import combine, reference


def _formula(a, b):
    """The published pairwise rule, written out independently in float64."""
    a, b = a.double().flatten(), b.double().flatten()
    dot = (a * b).sum()
    # Horovod's threshold: a squared norm below 1e-8 keeps the coefficient 1.
    ca = 1 - dot / (2 * (a * a).sum()) if (a * a).sum() >= 1e-8 else 1.0
    cb = 1 - dot / (2 * (b * b).sum()) if (b * b).sum() >= 1e-8 else 1.0
    return ca * a + cb * b


def test_orthogonal_vectors_add():
    a, b = torch.tensor([3.0, 0.0]), torch.tensor([0.0, -2.0])
    assert torch.equal(combine(a, b), a + b)


def test_parallel_vectors_average():
    a = torch.tensor([1.0, 2.0, -3.0])
    assert torch.allclose(combine(a, a), a)
    assert torch.allclose(combine(a, 3 * a), 2 * a)  # (1 - 3/2) a + (1 - 1/6) 3a


def test_zero_vector_is_neutral():
    a = torch.tensor([1.0, -1.0])
    assert torch.equal(combine(a, torch.zeros(2)), a)
    assert torch.equal(combine(torch.zeros(2), a), a)
    assert torch.equal(combine(torch.zeros(2), torch.zeros(2)), torch.zeros(2))


def test_tiny_vectors_are_summed_as_in_horovod():
    # Squared norms below 1e-8 keep their coefficient 1: two equal tiny
    # changes add up (the rule would average them), as Horovod computes.
    a = torch.full((4,), 1e-5, dtype=torch.float64)  # squared norm 4e-10
    assert torch.equal(combine(a, a), 2 * a)
    big = torch.full((4,), 1e-3, dtype=torch.float64)  # squared norm 4e-6: the rule applies
    assert torch.allclose(combine(big, big), big)
    # one tiny, one not: only the tiny one keeps 1
    assert torch.allclose(combine(a, big), _formula(a, big))
    assert torch.allclose(combine(a, big), a + (1 - float(a @ big) / (2 * float(big @ big))) * big)


def test_combine_matches_formula_and_keeps_shape_and_dtype():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    out = combine(a, b)
    assert out.shape == (3, 4) and out.dtype == torch.float32
    assert torch.allclose(out.flatten().double(), _formula(a, b), atol=1e-6)
    half = combine(a.half(), b.half())
    assert half.dtype == torch.float16
    assert torch.allclose(half.double().flatten(), _formula(a.half(), b.half()), atol=2e-3)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_reference_follows_the_recursive_doubling_tree(n):
    g = torch.Generator().manual_seed(n)
    xs = [torch.randn(6, generator=g, dtype=torch.float64) for _ in range(n)]
    q = 1
    while q * 2 <= n:
        q *= 2
    # Fold the ranks beyond the largest power of two, then combine pairs level by level.
    level = [_formula(xs[i], xs[q + i]) if q + i < n else xs[i] for i in range(q)]
    while len(level) > 1:
        level = [_formula(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    assert torch.allclose(reference(xs), level[0], atol=1e-12)


def test_reference_needs_input():
    with pytest.raises(ValueError):
        reference([])
