"""hvdlike.jax (in progress)."""
