"""Guard calls on a pool that the generation fleet serves, spread over its replicas: `ReplicaScorer`, the
guard's `Scorer` (`score_next_token`) over a pool's replicas, which the app hands to the guard factory."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from routing.replicas import Replica
from routing.router import Router, RouteRequest, is_replica_failure


class ReplicaScorer:
    """`score_next_token` over the replicas of one pool (a `Scorer`): each call goes where the router's score
    (`Router.prefer`: load, KV, prefix affinity, the imbalance escape) puts it among the routable replicas,
    counting this scorer's calls in flight on each as load, so that concurrent calls spread while calls
    that share a prompt prefix (a guard's template) go where it is cached; when none is routable, to any of
    them (its engine's error is the guard's failure, which the policy's fail mode decides). A call's
    outcome feeds the replica's circuit breaker as a generation request's does (`is_replica_failure`)."""

    def __init__(self, replicas: Sequence[Replica], router: Router, clock: Callable[[], float]) -> None:
        if not replicas:
            raise ValueError("a pool has at least one replica")
        self.replicas = tuple(replicas)
        self._router = router
        self._clock = clock
        self._calls = {r.replica_id: 0 for r in self.replicas}

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
        replica = self._pick(prompt_token_ids, cache_salt)
        self._calls[replica.replica_id] += 1
        try:
            scores = await replica.engine.score_next_token(
                prompt_token_ids, token_ids, priority=priority, cache_salt=cache_salt
            )
        except Exception as exc:
            if is_replica_failure(exc):  # as a generation request's failure before its first token
                await replica.judge_failure(exc)
            raise
        finally:
            self._calls[replica.replica_id] -= 1
        replica.record_success()
        return scores

    def _pick(self, prompt_token_ids: Sequence[int], cache_salt: str | None) -> Replica:
        candidates = [r for r in self.replicas if r.routable] or self.replicas
        first = candidates[0]
        request = RouteRequest(
            request_id="guard",
            weights_sha256=first.weights_sha256,
            prompt_token_ids=tuple(prompt_token_ids),
            max_tokens=1,
            cache_salt=cache_salt,
            pool=first.pool,
        )
        return self._router.prefer(request, candidates, self._clock(), self._calls)


def by_pool(
    replicas: Sequence[Replica], router: Router, clock: Callable[[], float]
) -> dict[str, ReplicaScorer]:
    """One scorer per pool of `replicas`, in the order pools first appear, each choosing with `router`."""
    pools: dict[str, list[Replica]] = {}
    for replica in replicas:
        pools.setdefault(replica.pool, []).append(replica)
    return {pool: ReplicaScorer(members, router, clock) for pool, members in pools.items()}
