"""The tier row codecs (``kv/row_codec.py``) and ``TierStore``'s views: what an offloading cache stores and reads."""

from __future__ import annotations

import torch

from kvserve.kv.row_codec import Int4Rows, PlainRows, dequantize_int4, quantize_int4
from kvserve.kv.tiers import TierStore
from kvserve.policies import make_policy


def test_policies_declare_their_codec() -> None:
    assert type(make_policy("full").row_codec(2, 8, torch.float32)) is PlainRows
    assert type(make_policy("infinigen").row_codec(2, 8, torch.float32)) is PlainRows
    codec = make_policy("int4", group_size=4).row_codec(2, 8, torch.bfloat16)
    assert isinstance(codec, Int4Rows) and codec.group_size == 4
    specs = codec.specs()
    assert specs["k"].shape == (2, 4) and specs["k"].dtype == torch.uint8
    assert specs["k_scale"].shape == (2, 2, 2) and specs["k_scale"].dtype == torch.bfloat16


def test_int4_rows_round_trip_as_the_quantiser_does() -> None:
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(5, 2, 8, generator=gen), torch.randn(5, 2, 8, generator=gen)
    codec = Int4Rows(2, 8, torch.float32, group_size=4)
    encoded = codec.encode(k, v)
    flat = {name: rows.reshape(5, -1) for name, rows in encoded.items()}  # as a tier holds them, one row a slot
    got_k, got_v = codec.decode(flat, (5, 2, 8))
    assert torch.equal(got_k, dequantize_int4(*quantize_int4(k, 4), torch.float32))
    assert torch.equal(got_v, dequantize_int4(*quantize_int4(v, 4), torch.float32))


def test_plain_rows_are_the_rows() -> None:
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    codec = PlainRows(2, 4, torch.float32)
    got = codec.decode({name: rows.reshape(3, -1) for name, rows in codec.encode(k, v).items()}, (3, 2, 4))
    assert torch.equal(got[0], k) and torch.equal(got[1], v)


def test_tier_store_views_and_block_copies() -> None:
    store = TierStore("host", 2, 3, 4, PlainRows(2, 5, torch.float32).specs())
    store.arrays["k"].copy_(torch.arange(store.arrays["k"].numel(), dtype=torch.float32).view_as(store.arrays["k"]))
    layer1 = store.arrays["k"][1]  # (slots, Hkv, D)
    assert torch.equal(store.by_slot("k", 1)[6], layer1[6].flatten())
    assert torch.equal(store.by_head("k", 1)[6 * 2 + 1], layer1[6, 1])
    assert torch.equal(store.by_block("k", 1)[2], layer1[8:12].flatten())
    assert store.blocks("k").shape == (2, 3, 4, 2, 5)
    assert store.block_bytes() == 2 * (2 * 2 * 5 * 4) * 4  # K and V, every layer, 4 slots
    before = store.arrays["k"].clone()
    store.copy_blocks([(0, 2)])
    assert torch.equal(store.blocks("k")[:, 2], before.view(2, 3, 4, 2, 5)[:, 0])
