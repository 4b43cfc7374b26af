"""The direct-I/O disk tier (kv/direct_tier.py): blocks round-trip through a file opened with O_DIRECT (whole
blocks straight to the file, partial ones through the write buffer, read-modify-write into a block's middle),
forks and slot copies, what it reads from the device, and its errors: a folder it cannot write and a file system
without O_DIRECT are KVTierErrors naming the folder."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch

from kvserve.errors import KVTierError
from kvserve.kv import direct_tier
from kvserve.kv.direct_tier import DirectTier, staging_rows
from kvserve.kv.tiers import RowSpec
from kvserve.platform.faults import faults

LAYERS, BLOCKS, BS = 3, 10, 4
ROWS = {"k": RowSpec((2, 64), torch.float32), "v": RowSpec((2, 64), torch.float32)}  # 2 KiB a block each


def _direct_io_supported(folder: Path) -> bool:
    probe = folder / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_RDWR | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    if not _direct_io_supported(tmp_path):
        pytest.skip(f"the file system of {tmp_path} does not support O_DIRECT (tmpfs?): nothing to test it on")
    return tmp_path


@pytest.fixture
def tier(folder: Path):
    tier = DirectTier(LAYERS, BLOCKS, BS, ROWS, folder, threads=3)
    yield tier
    tier.close()


def _rows(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn((n, *spec.shape), generator=g) for name, spec in ROWS.items()}


def _read(tier: DirectTier, layer: int, blocks: list[int]) -> dict[str, torch.Tensor]:
    out, views = {}, {}
    for name, spec in ROWS.items():
        out[name], views[name] = staging_rows(len(blocks) * BS, spec)
    tier.read(layer, [(b, i) for i, b in enumerate(blocks)], views).wait()
    return {name: t.clone() for name, t in out.items()}


def test_layout_is_one_aligned_extent_per_layer_and_block(tier, folder) -> None:
    assert tier.extent == 4096  # K's 2 KiB and V's 2 KiB of a block, one page
    assert tier.nbytes == LAYERS * BLOCKS * 4096
    assert list(folder.iterdir()) == []  # the file is unlinked at once
    assert os.fstat(tier.fd).st_size == tier.nbytes  # reserved up front
    assert os.O_DIRECT & __import__("fcntl").fcntl(tier.fd, __import__("fcntl").F_GETFL)


def test_whole_blocks_round_trip_through_the_file(tier) -> None:
    slots = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15, 28, 29, 30, 31])  # blocks 2, 3 and 7, whole
    rows = _rows(slots.numel(), 0)
    tier.write_rows(1, slots[torch.randperm(12, generator=torch.Generator().manual_seed(1))], rows)
    assert not tier._tails  # whole blocks go straight to the file
    rows_by_slot = _rows(slots.numel(), 0)
    order = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    expect = {name: torch.empty_like(r) for name, r in rows_by_slot.items()}
    for name in ROWS:
        expect[name][order] = rows_by_slot[name]  # slot order
    before = dict(tier.stats)
    got = _read(tier, 1, [2, 3, 7])
    for name in ROWS:
        assert torch.equal(got[name], expect[name])
    assert tier.stats["disk_read"] - before["disk_read"] == 3 * tier.extent  # from the device
    assert tier.stats["reads"] - before["reads"] == 2  # blocks 2-3 are one preadv, 7 another
    assert torch.equal(_read(tier, 0, [2])["k"], torch.zeros(BS, 2, 64))  # another layer: untouched


def test_partial_blocks_are_buffered_until_their_last_row(tier) -> None:
    rows = _rows(BS, 3)
    for offset in range(BS):  # a decode: one row a step into block 5
        tier.write_rows(2, torch.tensor([5 * BS + offset]), {n: r[offset : offset + 1] for n, r in rows.items()})
        assert bool(tier._tails) == (offset < BS - 1)
        got = _read(tier, 2, [5])
        for name in ROWS:
            assert torch.equal(got[name][: offset + 1], rows[name][: offset + 1])
    written = tier.stats["disk_written"]
    assert written == tier.extent  # the block once, whole, when complete
    assert torch.equal(_read(tier, 2, [5])["v"], rows["v"])  # now from the device


def test_a_store_into_a_blocks_middle_reads_it_first(tier) -> None:
    rows = _rows(BS, 4)
    tier.write_rows(0, torch.arange(4 * BS, 5 * BS), rows)  # block 4, whole, on disk
    tier.write_rows(0, torch.tensor([4 * BS + 2]), _rows(1, 5))  # overwrite its row 2
    got = _read(tier, 0, [4])
    expect = {n: r.clone() for n, r in rows.items()}
    for name, r in _rows(1, 5).items():
        expect[name][2] = r[0]
    for name in ROWS:
        assert torch.equal(got[name], expect[name])


def test_the_write_buffer_writes_out_its_oldest_blocks_past_its_size(folder) -> None:
    tier = DirectTier(LAYERS, BLOCKS, BS, ROWS, folder, max_buffered_bytes=2 * 4096)
    try:
        rows = _rows(3, 6)
        tier.write_rows(0, torch.tensor([0, 4, 8]), rows)  # first rows of blocks 0, 1, 2: three partial blocks
        assert list(tier._tails) == [(0, 1), (0, 2)]  # block 0 went to the file as it was
        got = _read(tier, 0, [0, 1, 2])
        for name in ROWS:
            assert torch.equal(got[name][[0, 4, 8]], rows[name])
    finally:
        tier.close()


def test_copy_blocks_and_slots_copy_every_layer(tier) -> None:
    for layer in range(LAYERS):
        tier.write_rows(layer, torch.arange(0, 2 * BS), _rows(2 * BS, 10 + layer))  # blocks 0 and 1
        tier.write_rows(layer, torch.tensor([2 * BS]), _rows(1, 20 + layer))  # block 2's first row (buffered)
    tier.copy_blocks([(0, 6), (2, 7)])
    tier.copy_slots([(1, 9 * BS + 3)])
    for layer in range(LAYERS):
        src, dst = _read(tier, layer, [0, 2]), _read(tier, layer, [6, 7, 9])
        for name in ROWS:
            assert torch.equal(dst[name][:BS], src[name][:BS])
            assert torch.equal(dst[name][BS], src[name][BS])
            assert torch.equal(dst[name][2 * BS + 3], src[name][1])


def test_an_unwritable_folder_is_a_clear_error_naming_it(folder, monkeypatch) -> None:
    if os.geteuid() == 0:  # root writes anywhere: what a read-only mount answers

        def read_only(**kwargs):
            raise OSError(errno.EROFS, "Read-only file system")

        monkeypatch.setattr(direct_tier.tempfile, "mkstemp", read_only)
    else:
        folder.chmod(0o500)
    try:
        with pytest.raises(KVTierError, match=r"cannot create its file in .*(EROFS|EACCES)") as info:
            DirectTier(LAYERS, BLOCKS, BS, ROWS, folder)
        assert str(folder) in str(info.value)
    finally:
        folder.chmod(0o700)


def test_a_file_system_without_direct_io_is_a_clear_error_naming_the_folder(folder, monkeypatch) -> None:
    real = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")  # what tmpfs answers
        return real(path, flags, *args)

    monkeypatch.setattr(direct_tier.os, "open", no_direct)
    with pytest.raises(KVTierError, match="does not support direct I/O .*kv_disk_io='mmap'") as info:
        DirectTier(LAYERS, BLOCKS, BS, ROWS, folder)
    assert str(folder) in str(info.value)
    assert list(folder.iterdir()) == []


def test_tmpfs_is_refused_at_start(tmp_path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or _direct_io_supported(shm):
        pytest.skip("no tmpfs without O_DIRECT at /dev/shm to try")
    with pytest.raises(KVTierError, match="/dev/shm.*does not support direct I/O"):
        DirectTier(LAYERS, BLOCKS, BS, ROWS, shm)


def test_block_parts_must_be_aligned_for_direct_reads(folder) -> None:
    odd = {"k": RowSpec((3,), torch.float32)}  # 12-byte rows: a block of 4 is 48 bytes
    with pytest.raises(ValueError, match="multiple of the device's direct-I/O alignment"):
        DirectTier(LAYERS, BLOCKS, BS, odd, folder)


def test_io_errors_are_tier_errors_naming_the_folder(tier, folder) -> None:
    tier.write_rows(0, torch.arange(BS), _rows(BS, 7))
    with faults({"kv-disk": 1.0}):
        with pytest.raises(KVTierError, match=f"direct read in '{folder}'.*EIO"):
            _read(tier, 0, [0])
        with pytest.raises(KVTierError, match=f"direct write in '{folder}'.*EIO"):
            tier.write_rows(0, torch.arange(BS), _rows(BS, 7))
    os.close(tier.fd)  # a read the device refuses (EBADF) surfaces at wait
    views = {name: staging_rows(BS, spec)[1] for name, spec in ROWS.items()}
    with pytest.raises(KVTierError, match=f"direct read in '{folder}'.*EBADF"):
        tier.read(0, [(1, 0)], views).wait()
    tier.fd = -1
