"""Deploying the fleet: the Kubernetes manifests (`ops/deploy/kubernetes`), the container image
(`ops/deploy/Containerfile`), their secrets (`ops.deploy.secrets`) and the `vllm serve` replicas' flags
(`ops.deploy.vllm_server`)."""
