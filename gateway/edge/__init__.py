"""The edge: what sits between the ASGI server and the route handlers.

    stack       the app class (`Gateway`): overload gate -> observe middleware -> fast path -> Litestar
    fastpath    the generation routes answered without Litestar's request cycle
    adapter     every use of Litestar internals (route lookup, scope keys, exception-handler lookup,
                response encoding), checked by tests/gateway/test_litestar_contract.py
    inbound     the HTTP request as the generation pipeline reads it
    decoding    request bodies within the route's limit, decoded with errors that name the field
    requestid   `x-request-id` on every answer
    security    authentication and role checks (the `principal` dependency)

Two layers: the plumbing (`adapter`, `inbound`, `decoding`, `requestid`, `security`) is imported by the API,
the pipeline and the observer; `fastpath` and `stack` import those in turn. Nothing is re-exported here, so
importing the plumbing never pulls in the stack.
"""
