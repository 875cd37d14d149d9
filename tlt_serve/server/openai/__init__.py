"""The OpenAI dialect: completions and chat completions (bodies, validation into jobs,
responses and SSE chunks, the routes) and ``/v1/models``."""
