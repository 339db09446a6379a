"""A vLLM general plugin (entry point group `vllm.general_plugins`): seeded sampling with chunked prefill on
CPU.

vLLM 0.32 takes back a random draw it discards (the token sampled after a chunk that is not the prompt's last)
with `Generator.set_offset`, which CPU generators do not have: the worker raises "CPU Generator does not use
offset" and the engine core dies. With a step budget smaller than the prompt (the point of bounded steps),
any request with a `seed` would take the engine down. On CPU platforms this plugin gives each seeded request
a generator that rewinds instead, to its state right after seeding: before a prompt's last chunk no draw has
been accepted, so the seed gives the same tokens however the prompt was chunked. (A request preempted and
recomputed after it had accepted tokens restarts its random stream: rare, and still deterministic.)

vLLM loads general plugins in each of its processes, the worker included; loading twice is harmless.
"""

from __future__ import annotations

from typing import Any

import torch


class RewindableCpuGenerator(torch.Generator):
    """A CPU generator whose `set_offset` (vLLM's roll-back of a discarded draw) returns to its seeded
    state."""

    _seeded_state: torch.Tensor

    @classmethod
    def seeded_like(cls, generator: torch.Generator) -> RewindableCpuGenerator:
        """A copy of a freshly seeded CPU `generator` that remembers that state."""
        copy = cls(device="cpu")  # torch.Generator takes its arguments in __new__: no __init__ of our own
        copy._seeded_state = generator.get_state()
        copy.set_state(copy._seeded_state)
        return copy

    def get_offset(self) -> int:
        """No offsets on CPU: vLLM only uses the value to call `set_offset`."""
        return 0

    def set_offset(self, offset: int) -> RewindableCpuGenerator:
        """Undo the draws since seeding (vLLM calls this only for draws it discards)."""
        self.set_state(self._seeded_state)
        return self


def register() -> None:
    """Install the rewinding generators in vLLM's per-request state, on CPU platforms only."""
    from vllm.platforms import current_platform
    from vllm.v1.worker import gpu_input_batch

    state_class: Any = gpu_input_batch.CachedRequestState
    if not current_platform.is_cpu() or getattr(state_class, "_lockgate_rewind", False):
        return
    original = state_class.__post_init__

    def post_init(self: Any) -> None:
        original(self)
        generator = self.generator
        if (
            generator is not None
            and generator.device.type == "cpu"
            and not isinstance(generator, RewindableCpuGenerator)
        ):
            self.generator = RewindableCpuGenerator.seeded_like(generator)

    state_class.__post_init__ = post_init
    state_class._lockgate_rewind = True
