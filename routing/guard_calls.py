"""Guard calls on a pool that the generation fleet serves, spread over its replicas: `ReplicaScorer`, the
guard's `Scorer` (`score_next_token`) over a pool's replicas, which the app hands to the guard factory."""

from __future__ import annotations

from collections.abc import Sequence

from routing.replicas import Replica
from routing.router import is_replica_failure


class ReplicaScorer:
    """`score_next_token` over the replicas of one pool (a `Scorer`): each call goes to the routable replica
    with the fewest guard calls of its own in flight, then the fewest requests as the router counts them,
    then the next in turn; when none is routable, to any of them (its engine's error is the guard's failure,
    which the policy's fail mode decides). A call's outcome feeds the replica's circuit breaker as a
    generation request's does (`is_replica_failure`). Without it every guard call of the pool went to its
    first replica."""

    def __init__(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            raise ValueError("a pool has at least one replica")
        self.replicas = tuple(replicas)
        self._calls = {r.replica_id: 0 for r in self.replicas}
        self._turn = 0

    @property
    def max_model_len(self) -> int:
        """The shortest context of the pool's replicas (a call may go to any of them)."""
        return min(r.engine.max_model_len for r in self.replicas)

    async def score_next_token(
        self,
        prompt_token_ids: Sequence[int],
        token_ids: Sequence[int],
        *,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> dict[int, float]:
        """The chosen replica's first-token log-probabilities of exactly `token_ids`."""
        replica = self._pick()
        self._calls[replica.replica_id] += 1
        try:
            scores = await replica.engine.score_next_token(
                prompt_token_ids, token_ids, priority=priority, cache_salt=cache_salt
            )
        except Exception as exc:
            if is_replica_failure(exc):  # as a generation request's failure before its first token
                await replica.judge_failure()
            raise
        finally:
            self._calls[replica.replica_id] -= 1
        replica.record_success()
        return scores

    def _pick(self) -> Replica:
        count = len(self.replicas)
        turn, self._turn = self._turn, (self._turn + 1) % count
        candidates = [i for i, r in enumerate(self.replicas) if r.routable] or range(count)

        def key(i: int) -> tuple[int, int, int]:
            replica = self.replicas[i]
            return self._calls[replica.replica_id], replica.queue_depth, (i - turn) % count

        return self.replicas[min(candidates, key=key)]


def by_pool(replicas: Sequence[Replica]) -> dict[str, ReplicaScorer]:
    """One scorer per pool of `replicas`, in the order pools first appear."""
    pools: dict[str, list[Replica]] = {}
    for replica in replicas:
        pools.setdefault(replica.pool, []).append(replica)
    return {pool: ReplicaScorer(members) for pool, members in pools.items()}
