"""hvdlike.keras (in progress)."""
