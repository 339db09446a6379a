"""`POST /v1/embeddings`: texts embedded by an embedding model of the registry, answered in OpenAI's shape.

    decode -> texts -> resolve the model -> count tokens -> reserve quota -> one input check per text
           -> embed -> settle -> vectors

`model` names an `embedding_model` (an alias, or a pinned `name@version`); the packaged MiniLM encoder is
published at start-up as `all-MiniLM-L6-v2`. Every tenant may use any embedding model. Each input is checked
by the tenant's input guard exactly as a moderation's is (one untrusted span, direction `input`, recorded
with `purpose=embedding`), before anything reaches the encoder: a blocked input refuses the whole request
(400 `content_policy_violation`) and no vector is computed.

Metering is a request's: the inputs' tokens (the embedding model's tokenizer, [CLS] and [SEP] included, as
`usage` reports them) and one request are reserved before any check, and charged once the vectors are
computed; a refused or failed request gets its reservation back.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any, Final

import msgspec
import numpy as np
from litestar import Request, Response, post
from litestar.di import NamedDependency
from litestar.openapi.datastructures import ResponseSpec
from litestar.status_codes import HTTP_200_OK

from gateway.api.checked_inputs import check_text, input_context, reserve_inputs
from gateway.api.openapi import errors, request_body, secured
from gateway.edge.decoding import Decoder, read_body
from gateway.edge.security import allow
from gateway.errors import InvalidRequestError, NotFoundError
from gateway.generation.guarding import GUARD_HEADER
from gateway.generation.metering import charge_headers
from gateway.generation.pipeline import MODEL_HEADER
from gateway.generation.resolution import policy_for
from gateway.observe.timeline import timeline_in
from gateway.requestid import request_id_of
from gateway.schemas import Embedding, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from gateway.services import Services
from guard.embedding import Vectors
from policy.auth import Principal
from registry.errors import InvalidError as RegistryInvalidError
from registry.errors import NotFoundError as RegistryNotFoundError
from registry.view import ResolvedEmbeddingModel

# The request body, decoded with errors that name the field (immutable: shared by every request).
_REQUEST = Decoder(EmbeddingRequest)
# Inputs per request, as OpenAI's.
MAX_INPUTS: Final = 2048


def input_texts(value: str | Sequence[str | int | list[int]]) -> list[str]:
    """The texts to embed: `input` as a string or a list of strings; a 400 naming the field otherwise (an
    empty string or list, more than MAX_INPUTS items, token ids)."""
    texts = [value] if isinstance(value, str) else value
    if not texts:
        raise InvalidRequestError(
            f"`input` is an empty list; send a string or a list of 1 to {MAX_INPUTS} strings",
            param="input",
            code="invalid_value",
        )
    if len(texts) > MAX_INPUTS:
        raise InvalidRequestError(
            f"`input` holds {len(texts)} items; at most {MAX_INPUTS} per request",
            param="input",
            code="invalid_value",
        )
    if not all(isinstance(text, str) for text in texts):
        raise InvalidRequestError(
            "`input` holds token ids; this gateway embeds text only (send strings)",
            param="input",
            code="unsupported_parameter",
        )
    strings = [text for text in texts if isinstance(text, str)]
    for i, text in enumerate(strings):
        if not text:
            where = _param(value, i)
            raise InvalidRequestError(f"`{where}` is an empty string", param=where, code="invalid_value")
    return strings


def resolve(services: Services, name: str, principal: Principal) -> ResolvedEmbeddingModel:
    """The embedding model version `name` means for the caller's key: 404 when nothing of that name exists,
    400 when it names a generation model."""
    key = services.secret.model_key(principal.tenant.tenant_id, principal.key.key_id)
    view = services.registry.view
    try:
        return view.resolve_embedding_model(name, key)
    except RegistryInvalidError as exc:
        raise InvalidRequestError(f"bad model reference: {exc}", param="model", code="invalid_value") from exc
    except RegistryNotFoundError as exc:
        try:
            view.resolve_model(name, key)
        except (RegistryNotFoundError, RegistryInvalidError):
            raise NotFoundError(
                f"embedding model `{name}` does not exist: {exc}", param="model", code="model_not_found"
            ) from exc
        raise InvalidRequestError(
            f"model `{name}` is a generation model; send an embedding model (e.g. all-MiniLM-L6-v2)",
            param="model",
            code="model_not_embedding",
        ) from exc


async def run_embeddings(
    services: Services, req: EmbeddingRequest, request: Request[Any, Any, Any], principal: Principal
) -> Response[EmbeddingResponse]:
    """Check each input under the caller's tenant policy, then embed them all; OpenAI's
    `CreateEmbeddingResponse`."""
    request_id = request_id_of(request.scope)
    timeline = timeline_in(request.scope, services.clock)
    texts = input_texts(req.input)
    model = resolve(services, req.model, principal)
    spec = model.spec
    if req.dimensions is not None and not spec.allows_dimensions(req.dimensions):
        lengths = (
            f"{spec.dimensions} dimensions only"
            if spec.min_dimensions is msgspec.UNSET
            else f"{spec.min_dimensions} to {spec.dimensions} dimensions"
        )
        raise InvalidRequestError(
            f"`dimensions` is {req.dimensions}; {model.ref} makes vectors of {lengths}",
            param="dimensions",
            code="invalid_value",
        )
    policy = policy_for(services.generation, principal)
    timeline.policy = policy.ref
    start = timeline.now()
    encoder = await services.embedders.get(model)
    counts = await encoder.token_counts(texts)
    timeline.phase("render", start)
    limit = model.spec.max_input_tokens
    for i, count in enumerate(counts):
        if count > limit:
            where = _param(req.input, i)
            raise InvalidRequestError(
                f"`{where}` is {count} tokens; {model.ref} reads at most {limit} (special tokens included)",
                param=where,
                code="context_length_exceeded",
            )
    tokens = sum(counts)
    charge = await reserve_inputs(services, principal, request_id, len(texts), tokens, timeline)
    headers = charge_headers(charge)
    context = input_context(principal, request_id, "embedding")
    salt = services.secret.cache_salt(principal.tenant.tenant_id)
    try:
        start = timeline.now()
        try:
            decisions = [
                await check_text(
                    services, policy, text, context, salt, timeline, param=_param(req.input, i), blocking=True
                )
                for i, text in enumerate(texts)
            ]
        finally:
            timeline.phase("input_guard", start)
        vectors = await encoder.embed(texts)
    except BaseException:
        # Not answered (a check refused, the encoder failed, or the client left): all of it goes back.
        services.meter.settle_later(charge, 0)
        raise
    services.meter.settle_later(charge, tokens)
    headers[GUARD_HEADER] = "; ".join(d.label if d else "input=off" for d in decisions)
    headers[MODEL_HEADER] = model.ref
    body = EmbeddingResponse(
        data=_data(_cut(vectors, req.dimensions), req.encoding_format),
        model=req.model,
        usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
    )
    return Response(content=body, headers=headers)


def _param(value: str | Sequence[object], i: int) -> str:
    """The field an input's refusal names."""
    return "input" if isinstance(value, str) else f"input[{i}]"


def _cut(vectors: Vectors, dimensions: int | None) -> Vectors:
    """The first `dimensions` of each vector, re-normalised to unit length (a Matryoshka encoder's shorter
    vectors); all of them where `dimensions` is unset or the whole length."""
    if dimensions is None or dimensions >= vectors.shape[1]:
        return vectors
    head = vectors[:, :dimensions]
    norms = np.linalg.norm(head, axis=1, keepdims=True)
    cut: Vectors = (head / np.maximum(norms, 1e-12)).astype(np.float32, copy=False)
    return cut


def _data(vectors: Vectors, encoding_format: str) -> list[Embedding]:
    """One item per row: floats, or its little-endian float32 bytes in base64 (as OpenAI's)."""
    if encoding_format == "base64":
        rows = vectors.astype("<f4", copy=False)
        return [
            Embedding(index=i, embedding=base64.b64encode(row.tobytes()).decode())
            for i, row in enumerate(rows)
        ]
    return [
        Embedding(index=i, embedding=row) for i, row in enumerate(np.asarray(vectors, np.float32).tolist())
    ]


@post(
    "/v1/embeddings",
    status_code=HTTP_200_OK,
    dependencies=request_body(
        EmbeddingRequest,
        {"model": "all-MiniLM-L6-v2", "input": "The food was delicious."},
        {"model": "all-MiniLM-L6-v2", "input": ["first text", "second text"], "encoding_format": "base64"},
    ),
    responses={
        HTTP_200_OK: ResponseSpec(
            EmbeddingResponse,
            generate_examples=False,
            description=(
                "One vector per input, in order, in OpenAI's `CreateEmbeddingResponse` shape; "
                "`x-lockgate-model` names the embedding model version that made them."
            ),
        ),
        # Invalid input (a generation model, token ids, an input too long, a blocked input), an unknown
        # model, body over the limit, quota short.
        **errors(400, 404, 413, 429),
    },
)
async def embeddings(
    request: Request[Any, Any, Any],
    services: NamedDependency[Services],
    principal: NamedDependency[Principal],
) -> Response[EmbeddingResponse]:
    """OpenAI embeddings by an embedding model of the registry: each input is checked by the tenant's input
    guard first (recorded in the audit trail), and the request is metered by its tokens."""
    allow(principal, "consumer")
    body = await read_body(request)
    return await run_embeddings(services, _REQUEST.decode(body), request, principal)


ROUTES = [secured("openai", [embeddings])]
