"""Serving a model to many clients, apart from the model (between decoders/ and tools/):

    scheduler.py    ContinuousBatcher: requests come and go while the batch keeps running
    engine.py       Engine: the thread that steps the batcher, with Prometheus metrics
    openai_api.py   create_app(engine): the OpenAI-compatible HTTP API (FastAPI)
    limits.py       BodySizeLimit: a body over the bound is a 413 before it is parsed
    auth.py         BearerAuth: the API key on every route but /health and /metrics
    text_checks.py  invalid_text: strings that are not valid Unicode (lone surrogates)
    shutdown.py     GracefulServer: uvicorn that drains the engine on SIGTERM
    stop_strings.py where a stop string begins, and how much text may still begin one
    request_fields.py   the API's request bodies (pydantic): every field used, or a 400 naming it
    logprobs.py     tokens' log-probabilities, in the API's shapes
    tokenizer_routes.py  /tokenize, /detokenize, /tokenizer_info (vLLM's)
    structured.py   the tokens a request may take next, by a grammar (llguidance): response_format
    tool_calls.py   tools rendered by the chat template, calls read back in OpenAI's shape

`pyhlo serve` (tools/serve.py) is the command over them. serving imports decoders; decoders
never imports serving. The engine and the API need the `serve` extras (fastapi, uvicorn,
prometheus_client); the scheduler needs only the library.
"""
from serving.scheduler import ContinuousBatcher, Request

__all__ = ["ContinuousBatcher", "Request"]
