"""The OpenAI-compatible HTTP front door of both services (Starlette app served by uvicorn on the
services' own event loop): request parsing, response objects, SSE framing, error objects."""
