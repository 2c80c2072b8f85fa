"""The bounded memo behind the shared-memory views and the executor's offer terms."""

from hvdlike.core.memo import BoundedMemo


def test_a_bounded_memo_keeps_at_most_its_limit_then_starts_over():
    views = BoundedMemo(limit=2)
    assert views.add("a", [1]) == [1] and views.add("b", [2]) == [2]
    assert views.get("a") == [1] and len(views) == 2
    views.add("c", [3])  # a third key: the kept ones are dropped, not grown
    assert dict(views) == {"c": [3]}
