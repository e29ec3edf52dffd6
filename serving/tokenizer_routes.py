"""The tokenizer over HTTP, as vLLM serves it, so that clients (lm-evaluation-harness's
tokenizer_backend=remote) use the server's own tokenizer with nothing to download:

    POST /tokenize        {prompt | messages, add_special_tokens} -> {tokens, count, max_model_len}
    POST /detokenize      {tokens} -> {prompt}
    GET  /tokenizer_info  the tokenizer's class, special tokens and chat template
"""
from __future__ import annotations

from typing import Any, Callable

from fastapi import APIRouter

from serving.request_fields import DetokenizeRequest, TokenizeRequest


def tokenizer_routes(engine: Any, check_model: Callable[[str | None], None],
                     error: type[Exception]) -> APIRouter:
    """The routes over engine.tokenizer; check_model refuses another model's name, error(status,
    message, param) is the API's error."""
    router = APIRouter()
    tokenizer = engine.tokenizer
    vocab = engine.model.decoder.head.vocab_size

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model)
        if body.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise error(400, "this model's tokenizer has no chat template: tokenize a prompt", "messages")
            text = tokenizer.apply_chat_template([m.for_template() for m in body.messages], tokenize=False,
                                                 add_generation_prompt=body.add_generation_prompt,
                                                 continue_final_message=body.continue_final_message)
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        tokens = list(tokenizer(text, add_special_tokens=special)["input_ids"])
        strings = tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
        return {"count": len(tokens), "max_model_len": engine.n_positions, "tokens": tokens,
                "token_strs": strings}

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise error(400, f"tokens: token ids must lie in 0..{vocab - 1}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    @router.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return {"tokenizer_class": type(tokenizer).__name__, "model_max_length": engine.n_positions,
                "vocab_size": vocab, "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
                "chat_template": getattr(tokenizer, "chat_template", None)}

    return router
