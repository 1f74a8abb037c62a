"""The OpenAI-compatible HTTP API of the gateway (FastAPI on uvicorn, in the gateway's own event loop)."""
