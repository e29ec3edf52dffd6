"""Serving a model to many clients, apart from the model (between decoders/ and tools/):

    scheduler.py    ContinuousBatcher: requests come and go while the batch keeps running
    engine.py       Engine: the thread that steps the batcher, with Prometheus metrics
    openai_api.py   create_app(engine): the OpenAI-compatible HTTP API (FastAPI)
    structured.py   the tokens a request may take next, by a grammar (llguidance): response_format
    tool_calls.py   tools rendered by the chat template, calls read back in OpenAI's shape

`pyhlo serve` (tools/serve.py) is the command over them. serving imports decoders; decoders
never imports serving. The engine and the API need the `serve` extras (fastapi, uvicorn,
prometheus_client); the scheduler needs only the library.
"""
from serving.scheduler import ContinuousBatcher, Request

__all__ = ["ContinuousBatcher", "Request"]
