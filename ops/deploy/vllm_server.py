"""The flags of a `vllm serve` replica that `engines.vllm_remote.VllmRemoteEngine` talks to: one list for the
Kubernetes StatefulSet (ops/deploy/kubernetes/base/vllm.yaml, checked against it by a test) and the test
suite's own server (tests/vllm_server.py)."""

from __future__ import annotations

import json

# What the remote engine's contract needs of every replica (its module docstring says why each).
STRUCTURED_OUTPUTS = {"backend": "xgrammar", "disable_any_whitespace": True}
CONTRACT_FLAGS = (
    "--scheduling-policy=priority",
    "--enable-prompt-tokens-details",
    f"--structured-outputs-config={json.dumps(STRUCTURED_OUTPUTS)}",
    "--worker-extension-cls=engines.vllm_local.ScoringWorkerExtension",
)
# Seconds a replica told to stop (SIGTERM) keeps serving the requests it has before it exits: vLLM refuses new
# ones meanwhile (the gateway fails those over before their first token), so a rolling restart cuts no stream
# that ends within it. The StatefulSet's terminationGracePeriodSeconds covers it (a test checks).
SHUTDOWN_TIMEOUT = 30


def server_flags(
    *,
    served_model: str,
    max_model_len: int,
    max_num_seqs: int,
    kv_cache_bytes: int,
    max_logprobs: int = 20,
    shutdown_timeout: int = SHUTDOWN_TIMEOUT,
    eager: bool = True,
) -> list[str]:
    """The replica's flags, each `--name=value` (or a bare switch), the contract's included; the model path,
    host, port and dtype are the caller's. `max_num_seqs` is what the gateway's `[engines.remote]
    max_num_seqs` must say, `max_model_len` its `max_model_len`; `shutdown_timeout`: the drain on SIGTERM
    (`SHUTDOWN_TIMEOUT`). `eager` (last, so that an overlay can drop
    it): no CUDA graphs, the only choice on CPU; on a GPU they trade a start of seconds for faster steps."""
    flags = [
        f"--served-model-name={served_model}",
        f"--max-model-len={max_model_len}",
        f"--max-num-seqs={max_num_seqs}",
        f"--kv-cache-memory-bytes={kv_cache_bytes}",
        f"--max-logprobs={max_logprobs}",
        f"--shutdown-timeout={shutdown_timeout}",
        *CONTRACT_FLAGS,
    ]
    return [*flags, "--enforce-eager"] if eager else flags
