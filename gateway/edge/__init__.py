"""The edge: what sits between the ASGI server and the route handlers.

    stack       the app class (`Gateway`): overload gate -> observe middleware -> fast path -> Litestar
    fastpath    the generation routes answered without Litestar's request cycle
    sessions    a session's step as a chat completion (the sessions route's and the chat route's header)
    adapter     every use of Litestar internals (route lookup, scope keys, exception-handler lookup,
                response encoding), checked by tests/gateway/test_litestar_contract.py
    handlers    the app's exception handlers: every error in the OpenAI shape, noted on the timeline
    decoding    request bodies within the route's limit, decoded with errors that name the field
    security    authentication and role checks (the `principal` dependency)

The API and the console import the edge; the edge imports the pipeline, the services and the observer, never
a route module (the route handlers of the generation routes call `fastpath.generate`). The request
vocabulary the pipeline shares with it (`gateway.inbound`, `gateway.requestid`) is at the package root.
Nothing is re-exported here.
"""
