"""What the engine does when a KV tier (swap space, an offload tier's host or disk arrays) fails a transfer.

The step is given up. Only the requests it touched (run, swapped out or in) are affected: each computes again
from its tokens (exact, as preemption by recompute is); one that faults a second time ends with finish_reason
"error" and the fault's message. Everyone else is served as before.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from kvserve.attention.backend import AttentionBackend
from kvserve.core.outputs import RequestOutput
from kvserve.core.request import Request, RequestStatus, Sequence
from kvserve.core.scheduler import Scheduler
from kvserve.core.step import SchedulerOutput
from kvserve.errors import KVTierError
from kvserve.kv.manager import KVCacheManager
from kvserve.log import get_logger


class TierFaultRecovery:
    def __init__(self, scheduler: Scheduler, cache: AttentionBackend, kv: KVCacheManager) -> None:
        self.scheduler = scheduler
        self.cache = cache
        self.kv = kv
        self._faulted: set[str] = set()  # requests recomputed once after a fault (a second one ends them)

    def recover(
        self,
        out: SchedulerOutput,
        error: KVTierError,
        seqs: Mapping[int, tuple[Request, Sequence]],
        requests: Mapping[str, Request],
        fail: Callable[[Request, KVTierError], RequestOutput],
    ) -> list[RequestOutput]:
        """Recompute or fail (through ``fail``) each request step ``out`` touched; their outputs."""
        if any(s.seq_id not in seqs for s in out.scheduled):
            raise error  # a Prompt Cache module's encoding ran in the step: no request owns it to recompute
        self.cache.recover()
        affected = {seqs[s.seq_id][0].request_id: seqs[s.seq_id][0] for s in out.scheduled}
        for request_id in out.preempted:  # swapped out in the step: the host copy may be incomplete
            request = requests.get(request_id)
            if request is not None and request.status == RequestStatus.SWAPPED:
                affected[request_id] = request
        error.request_ids = tuple(request_id for request_id in affected if request_id in self._faulted)
        get_logger().warning(
            "%s; recomputing %d requests, failing %d", error, len(affected) - len(error.request_ids),
            len(error.request_ids),
        )  # fmt: skip
        outputs = []
        for request in affected.values():
            if request.request_id in error.request_ids:
                outputs.append(fail(request, error))
            else:
                self._faulted.add(request.request_id)
                self.scheduler.recompute(request)
        self.kv.forget_free()  # a block the step wrote (or swapped in) may hold a failed copy: no prefix hits
        return outputs

    def forget(self, request_id: str) -> None:
        self._faulted.discard(request_id)
