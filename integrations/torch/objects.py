"""``broadcast_object`` and ``allgather_object`` (framework-neutral, see
:mod:`hvdlike.frontend.objects`), under the torch front end's name."""

from hvdlike.frontend.objects import allgather_object, broadcast_object

__all__ = ["allgather_object", "broadcast_object"]
