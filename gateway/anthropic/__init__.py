"""The Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`), served by translating each request to
the chat path.

Contract (each module states its own):
- `protocol`: the request bodies (`MessagesRequest`, `CountTokensRequest`), what is served and refused, and
  Anthropic's error envelope.
- `translate`: system, messages, tools, thinking → the `/v1/chat/completions` request that serves them.
- `render`: the chat run's events → the `message` (thinking / text / tool_use blocks) or its event stream.
- `routes`: the REST handlers gateway/app.py registers (`x-api-key` authentication).
"""
