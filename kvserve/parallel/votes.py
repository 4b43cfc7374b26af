"""A compressing policy's token scores over a parallel prefill: each rank votes with its own queries.

PyramidInfer and H2O choose which keys a layer keeps by the attention some of the prompt's queries pay
them (``KVPolicy.votes``: which queries, with what weight). Those queries are spread over the ranks, so
each rank scores the keys it can see ([0, end of its chunk)) with its own voting queries, and sends that
share to the last rank, which adds the shares up: the same scores as one process computing the whole
prompt, for a few kilobytes per layer. The last rank hands every layer's KV and scores to its sink once
all shares are in, after its forward pass, so no rank waits for another's attention mid-pass.

The KV itself still travels whole: which keys a layer keeps depends on queries a later rank has not yet
computed when the KV runs past it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from kvserve.policies.scoring import column_sums

Wait = Callable[[object, str], None]  # ChunkBackend.wait: a request, what it is for (timeouts, dead peers)


class PromptVotes:
    """One rank's end of the vote exchange of a parallel prefill (see the module doc).

    ``first``/``weights`` are the whole prompt's votes: queries first.. vote, with ``weights``
    (len - first,). Shares travel with tags ``num_layers + layer``, clear of the KV chain's ``layer``.
    """

    def __init__(
        self, first: int, weights: torch.Tensor, boundaries: tuple[int, ...], rank: int, num_layers: int, wait: Wait
    ) -> None:
        self.first, self.weights = first, weights
        self.rank, self.num_layers, self.wait = rank, num_layers, wait
        self.start, self.end = boundaries[rank], boundaries[rank + 1]
        self.last_rank = len(boundaries) - 2
        self.last = rank == self.last_rank
        # Ranks whose chunk holds voting queries, with how many keys their share covers.
        self.voters = {r: boundaries[r + 1] for r in range(len(boundaries) - 1) if boundaries[r + 1] > first}
        self.sending: list[tuple[torch.Tensor, object]] = []
        self.received: list[list[tuple[torch.Tensor, object]]] = []
        if self.last:
            for layer in range(num_layers):
                shares = [(torch.empty(n), r) for r, n in self.voters.items() if r != rank]
                self.received.append([(buf, dist.irecv(buf, src=r, tag=num_layers + layer)) for buf, r in shares])

    def share(self, layer: int, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor | None:
        """This rank's votes on ``keys`` (end, Hkv, D) from its queries q (chunk, H, D): (end,) float32,
        sent on to the last rank; None for a rank without voting queries."""
        if self.rank not in self.voters:
            return None
        first = max(0, self.first - self.start)
        weights = self.weights[self.start + first - self.first : self.end - self.first]
        votes = column_sums(q, keys[: self.end], self.start, first, weights)
        if not self.last:
            votes = votes.cpu()
            self.sending.append((votes, dist.isend(votes, dst=self.last_rank, tag=self.num_layers + layer)))
        return votes

    def total(self, layer: int, own: torch.Tensor | None) -> torch.Tensor:
        """The last rank: every share of ``layer`` added up, (prompt length,) float32."""
        total = torch.zeros(self.end, dtype=torch.float32)
        for buffer, work in self.received[layer]:
            self.wait(work, f"receiving layer {layer}'s votes")
            total[: buffer.numel()] += buffer
        if own is not None:
            total += own.cpu()
        return total

    def finish(self) -> None:
        for layer, (_, work) in enumerate(self.sending):
            self.wait(work, f"sending layer {layer}'s votes")
        self.sending.clear()
