"""A control plane closed under a thread still negotiating on it fails cleanly."""

import pytest

from hvdlike.core.errors import SHUT_DOWN, HvdlikeInternalError
from hvdlike.core.shm_control import ShmControlPlane


def test_negotiating_on_a_closed_plane_names_the_shutdown():
    # A peer's shutdown closes the plane while a user thread is mid-exchange on
    # a process set: its error read "'NoneType' object has no attribute 'mm'".
    plane = ShmControlPlane.__new__(ShmControlPlane)  # no segment: as close() leaves it
    plane.segment = None
    plane.size, plane.rank, plane.slot = 2, 0, 64
    with pytest.raises(HvdlikeInternalError, match=SHUT_DOWN):
        plane._exchange(b"x", lambda member: True)
