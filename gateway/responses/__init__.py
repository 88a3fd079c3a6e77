"""The OpenAI Responses API (`/v1/responses`), served by translating each request to the chat path.

Contract (each module states its own):
- `protocol`: the request body (`ResponsesRequest`, `parse_response_request`), what is served and what is refused.
- `translate`: input items and options → the `/v1/chat/completions` request that serves them.
- `render`: the chat run's events → the `response` object or its stream of events (reasoning / message /
  function_call items).
- `store`: the bounded, per-tenant in-memory store behind `store`, `previous_response_id` and `GET /v1/responses/{id}`.
- `routes`: the REST handlers gateway/app.py registers.
"""
