"""A request for n > 1 choices as n single-choice engine requests.

An engine generates one sequence per request. The gateway asks for `n` choices by sending `n` requests that
differ only in their id (`<id>-<i>`) and, when the client fixed a seed, in the seed (`seed + i`, so the
choices differ and the whole response is still reproducible). Their prompts are identical, so the engine's
prefix cache computes the prompt once. The deltas are tagged with their choice `index` when they are merged
(see `gateway.generation.flow`).
"""

from __future__ import annotations

import msgspec

from engines.base import EngineRequest


def split_choices(req: EngineRequest) -> list[EngineRequest]:
    """One single-choice request per choice of `req` (`[req]` itself when it asks for one)."""
    if req.n == 1:
        return [req]
    sampling = req.sampling
    return [
        msgspec.structs.replace(
            req,
            request_id=f"{req.request_id}-{i}",
            n=1,
            sampling=(
                sampling
                if sampling.seed is None
                else msgspec.structs.replace(sampling, seed=(sampling.seed + i) % 2**63)
            ),
        )
        for i in range(req.n)
    ]
