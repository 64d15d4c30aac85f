"""What a peer's credentials let it reach (lmcached/daemon/peers.py): the arena's segment
read as the kernel decides an open, from its mode and group now."""

import os

import pytest

from lmcached.daemon.peers import can_read_arena, is_member
from lmcached.shm.arena import Arena
from lmcached.shm.janitor import SHM_DIR

OTHER_UID = 54321  # no user on the machine: its groups are its primary gid only
MiB = 1 << 20


@pytest.fixture
def arena(unique_name):
    with Arena.create(unique_name, 4 * MiB, MiB, prefault=False) as arena:
        yield arena


def segment_path(arena: Arena) -> str:
    return os.path.join(SHM_DIR, arena.segment_name.lstrip("/"))


def test_is_member_by_primary_gid_or_the_group_database():
    assert is_member(OTHER_UID, 777, 777)
    assert not is_member(OTHER_UID, 777, 778)  # no user: no supplementary groups
    user_gid = os.getegid()
    assert is_member(os.geteuid(), user_gid, user_gid)


@pytest.mark.parametrize("mode, gid_is_segment_group, reads", [
    (0o600, True, False),
    (0o640, True, True),
    (0o620, True, False),  # write without read
    (0o640, False, False),
    (0o604, False, True),  # others' bits (the daemon refuses them, the kernel would not)
])
def test_a_peer_of_another_uid_reads_the_arena_as_the_segments_mode_says(
        arena, mode, gid_is_segment_group, reads):
    os.chmod(segment_path(arena), mode)
    segment_gid = arena.stat().st_gid
    gid = segment_gid if gid_is_segment_group else segment_gid + 1
    assert can_read_arena(OTHER_UID, gid, arena) is reads
    assert can_read_arena(os.geteuid(), gid, arena)  # the daemon's uid, and root, always
    assert can_read_arena(0, gid, arena)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root: chown to another uid")
def test_the_segments_owner_is_judged_by_the_owners_bits(arena):
    os.chown(segment_path(arena), OTHER_UID, -1)
    os.chmod(segment_path(arena), 0o060)  # the group may, its owner may not: no read
    assert not can_read_arena(OTHER_UID, arena.stat().st_gid, arena)
    os.chmod(segment_path(arena), 0o400)
    assert can_read_arena(OTHER_UID, arena.stat().st_gid + 1, arena)


def test_a_segment_that_cannot_be_inspected_is_not_readable(unique_name):
    arena = Arena.create(unique_name, 4 * MiB, MiB, mode=0o660, prefault=False)
    gid = arena.stat().st_gid
    assert can_read_arena(OTHER_UID, gid, arena)
    arena.close()
    assert not can_read_arena(OTHER_UID, gid, arena)
    assert can_read_arena(os.geteuid(), gid, arena)


def test_stat_reports_the_mode_and_group_now_and_of_a_memfd_arena(unique_name, arena):
    os.chmod(segment_path(arena), 0o640)
    st = arena.stat()
    assert (st.st_mode & 0o777, st.st_uid) == (0o640, os.geteuid())
    with Arena.create_memfd(unique_name, 1, 4 * MiB, MiB, prefault=False) as anon:
        assert anon.stat().st_size == 4 * MiB
