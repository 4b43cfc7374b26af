"""How a model's layers map onto KV groups and block storage: one group for a plain model, and for
models with sliding-window layers, groups of equal size as vLLM's hybrid KV cache manager makes them.

A block id names the same storage in every group: ``rows`` layers' worth of (block_size, Hkv, D).
Layer ``l`` of group ``g`` writes row ``layer_rows[l]`` of the blocks in ``g``'s table. With groups of
equal size (``rows`` layers each) no storage sits idle: a window group's block holds the KV of its
``rows`` sliding layers, a global group's block that of ``rows`` global layers. Gemma 3 270M (18
layers, every sixth global): one global group of 3 layers and five window groups of 3, so a block is 3
layers deep, and a sequence's window groups keep only the blocks their window still sees.

An offloading engine splits them between two pools instead (``split_offload_layout``): the global layers in one
group in the tier (the main pool, ``rows`` = their count), each window size's layers in one group on the device
(the side pool, ``side_rows`` deep), as ``attention/split_offload.py`` keeps them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.kv.manager import KVGroupSpec


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroupSpec, ...]
    layer_to_group: tuple[int, ...]  # () when there is one group
    layer_rows: tuple[int, ...]  # per layer, its row of a block; () when every layer has its own (one group)
    rows: int  # layers' worth of storage in one block (of the main pool)
    side_rows: int = 0  # layers' worth of storage in one block of the side pool (groups with pool=1); 0: none

    @property
    def windowed(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    @property
    def split(self) -> bool:
        """Window groups in a side pool on the device, global layers in the main pool (an offload tier)."""
        return self.side_rows > 0

    def pool_groups(self, pool: int) -> tuple[int, ...]:
        """Indices of the groups drawing blocks from ``pool`` (0: main, 1: side)."""
        return tuple(g for g, spec in enumerate(self.groups) if spec.pool == pool)


def single_group_layout(num_layers: int) -> KVLayout:
    """Every layer in one group, keeping every token: a block holds all layers."""
    return KVLayout((KVGroupSpec(),), (), (), num_layers)


def window_group_layout(layer_windows: Sequence[int | None]) -> KVLayout:
    """Groups of the layers sharing a window size (None: global), cut into groups of ``rows`` layers,
    ``rows`` being the smallest count of one kind; a last group of a kind may be shorter."""
    kinds = _layers_by_window(layer_windows)
    rows = min(len(layers) for layers in kinds.values())
    groups: list[KVGroupSpec] = []
    layer_to_group = [0] * len(layer_windows)
    layer_rows = [0] * len(layer_windows)
    for window, layers in kinds.items():
        for start in range(0, len(layers), rows):
            members = tuple(layers[start : start + rows])
            for row, layer in enumerate(members):
                layer_to_group[layer], layer_rows[layer] = len(groups), row
            groups.append(KVGroupSpec(members, sliding_window=window))
    return KVLayout(tuple(groups), tuple(layer_to_group), tuple(layer_rows), rows)


def split_offload_layout(layer_windows: Sequence[int | None]) -> KVLayout:
    """The global layers in one group of the main pool (an offload tier); each window size's layers in one group of
    the side pool (the device). Rows count per pool: a global layer's row among the global layers, a window layer's
    among its group's."""
    kinds = _layers_by_window(layer_windows)
    if None not in kinds or len(kinds) < 2:
        raise ValueError("a split layout needs global layers and sliding-window layers")
    groups = [KVGroupSpec(tuple(kinds.pop(None)))]
    groups += [KVGroupSpec(tuple(layers), sliding_window=window, pool=1) for window, layers in kinds.items()]
    layer_to_group = [0] * len(layer_windows)
    layer_rows = [0] * len(layer_windows)
    for g, spec in enumerate(groups):
        for row, layer in enumerate(spec.layer_ids):
            layer_to_group[layer], layer_rows[layer] = g, row
    side_rows = max(len(spec.layer_ids) for spec in groups[1:])
    return KVLayout(tuple(groups), tuple(layer_to_group), tuple(layer_rows), len(groups[0].layer_ids), side_rows)


def _layers_by_window(layer_windows: Sequence[int | None]) -> dict[int | None, list[int]]:
    """The layers of each window size (None: global), in the order the sizes first appear."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    return kinds
