"""The OpenAI Responses API over the chat completions pipeline: its wire shapes (`schemas`), a request as a
chat completion (`requests`), and a chat answer as a response or its event stream (`output`). The route is
`gateway.api.responses`."""
