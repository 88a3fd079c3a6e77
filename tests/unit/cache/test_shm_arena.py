"""The shared-memory arena file (create, attach with a token check, grow, close) and the first-fit extent allocator
(exact offsets, coalescing, growth)."""

import os

import pytest

from cache_service.shm_arena import HEADER_BYTES, TOKEN_OFFSET, ArenaMismatch, ExtentAllocator, SharedArena

K = 4096


# -- allocator ---------------------------------------------------------------------------------------------------


def test_first_fit_offsets_are_aligned_and_lowest():
    a = ExtentAllocator(16 * K)
    assert [a.allocate(n) for n in (1, K, K + 1, 0, 3 * K)] == [0, K, 2 * K, 0, 4 * K]  # 0 bytes: no space
    assert a.free_bytes == 16 * K - 7 * K and a.free_extents() == [(7 * K, 9 * K)]
    assert a.extent_bytes(K + 1) == 2 * K and a.extent_bytes(0) == 0


def test_freed_neighbours_coalesce_and_are_reused_lowest_first():
    a = ExtentAllocator(8 * K)
    offsets = [a.allocate(K) for _ in range(6)]  # 0 .. 5K; free tail [6K, 8K)
    a.free(offsets[1], K)
    a.free(offsets[3], K)
    assert a.free_extents() == [(K, K), (3 * K, K), (6 * K, 2 * K)]
    assert a.allocate(2 * K) == 6 * K  # no 2-page hole below the tail
    a.free(offsets[2], K)  # joins [K, 2K) and [3K, 4K) into one hole of 3 pages
    assert a.free_extents() == [(K, 3 * K)]
    assert a.allocate(3 * K) == K and a.free_extents() == [] and a.allocate(1) is None


def test_freeing_merges_with_both_sides_and_the_whole_space_comes_back():
    a = ExtentAllocator(4 * K)
    first, second, third = a.allocate(K), a.allocate(2 * K), a.allocate(K)
    for offset, size in ((first, K), (third, K), (second, 2 * K)):
        a.free(offset, size)
    assert a.free_extents() == [(0, 4 * K)] and a.free_bytes == 4 * K


@pytest.mark.parametrize("offset, size", [(0, K), (K // 2, K), (8 * K, K)])
def test_double_or_foreign_frees_raise(offset, size):
    a = ExtentAllocator(8 * K)
    a.allocate(K)
    a.free(0, K)
    with pytest.raises(ValueError):
        a.free(offset, size)


def test_extend_adds_space_at_the_end_merging_with_a_free_tail():
    a = ExtentAllocator(2 * K)
    assert a.allocate(K) == 0 and a.allocate(2 * K) is None
    a.extend(4 * K)
    assert a.free_extents() == [(K, 3 * K)] and a.allocate(2 * K) == K  # as a 4-page allocator would place it
    with pytest.raises(ValueError):
        a.extend(3 * K)


# -- the arena file ----------------------------------------------------------------------------------------------


def test_create_attach_write_read_and_close_unlinks(tmp_path):
    arena = SharedArena.create(10_000, tmp_path, populate=False, grow_step_bytes=K)
    try:
        assert arena.capacity == 3 * K and arena.size == HEADER_BYTES + 3 * K and arena.data_offset == HEADER_BYTES
        assert oct(os.stat(arena.path).st_mode & 0o777) == "0o600" and arena.backed == 0
        assert arena.grow(1) == K and arena.grow(K + 1) == 2 * K and arena.grow(10 * K) == 3 * K
        client = SharedArena.attach(arena.path, arena.size, arena.token, TOKEN_OFFSET)
        client.write(HEADER_BYTES + K, b"written by a client")
        assert arena.read(HEADER_BYTES + K, 19) == b"written by a client"
        with arena.view(HEADER_BYTES + K, 7) as view:
            assert bytes(view) == b"written"
        client.close()
        assert arena.path.exists()  # a client's close unmaps only
    finally:
        arena.close()
    assert not arena.path.exists()
    arena.close()  # idempotent


def test_attach_refuses_another_token_size_or_path(tmp_path):
    arena = SharedArena.create(K, tmp_path, populate=False)
    try:
        with pytest.raises(ArenaMismatch):
            SharedArena.attach(arena.path, arena.size, bytes(16), TOKEN_OFFSET)
        with pytest.raises(ArenaMismatch):
            SharedArena.attach(arena.path, arena.size + K, arena.token, TOKEN_OFFSET)
        with pytest.raises(ArenaMismatch):
            SharedArena.attach(tmp_path / "nope", arena.size, arena.token, TOKEN_OFFSET)
    finally:
        arena.close()


def test_two_arenas_never_share_a_token_or_file(tmp_path):
    a, b = SharedArena.create(K, tmp_path, populate=False), SharedArena.create(K, tmp_path, populate=False)
    try:
        assert a.token != b.token and a.path != b.path and len(a.token) == 16
    finally:
        a.close()
        b.close()
