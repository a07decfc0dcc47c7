"""What ``longspec serve`` takes from a request body: every field checked (an OpenAI-style 400 error
otherwise, :class:`APIError`) and the prompt turned into a :class:`~longspec.engine.engine.Sequence`
(token ids as given, a text tokenised, chat messages rendered by the model's chat template and
tokenised through the :class:`~longspec.serving.tokenizing.PieceCache`)."""
from __future__ import annotations

from typing import Optional

from ..engine.engine import Sequence
from ..engine.sequence import cache_need
from ..spec.sampling import check_sampling_args

class APIError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the error object's fields."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


UNSUPPORTED = ("n", "logprobs", "echo", "best_of", "suffix", "tools", "functions", "logit_bias",
               "response_format", "top_logprobs", "tool_choice", "parallel_tool_calls", "function_call")
UNSUPPORTED_PENALTIES = ("presence_penalty", "frequency_penalty", "repetition_penalty")
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
TEXT_MARGIN = 4  # a normaliser may merge characters (e.g. NFKC composing accents): a wide margin


def _number(body: dict, name: str, kind, default, lo=None, hi=None):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise APIError(400, f"'{name}' must be a{'n integer' if kind is int else ' number'}, got {value!r}", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise APIError(400, f"'{name}' must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}", name)
    return kind(value)


def decode_json(raw: bytes):
    """The request body as JSON (NaN, Infinity and nesting deeper than 200 refused), parsed by
    pydantic-core (FastAPI's): twice as fast as the json module on a long prompt's token ids.
    Raises APIError."""
    from pydantic_core import from_json

    try:
        return from_json(raw, allow_inf_nan=False)
    except ValueError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None


class RequestParsing:
    """The part of :class:`~longspec.serving.server.Server` that reads request bodies. It works on the
    server's ``engine``, ``tokenizer``, ``model_name``, ``eos``, ``max_len``, ``token_chars`` and
    ``pieces``."""

    def _check_chars(self, chars: int, param: str) -> None:
        if self.token_chars and chars > TEXT_MARGIN * self.token_chars * self.max_len:
            raise APIError(400, f"the prompt ({chars} characters) has more tokens than this server holds per request "
                                f"({self.max_len})", param, "context_length_exceeded")

    def parse(self, raw: bytes, chat: bool, tenant=None) -> tuple:
        """Request body (bytes) -> (Sequence, stop strings, stream). Every field is checked
        before the prompt is tokenised. ``tenant``: the API key's index (None: no keys); with the
        body's ``cache_salt`` it is the sequence's cache namespace (its cached prompt blocks are
        shared with the same tenant and salt only). Raises APIError. Runs off the event loop."""
        body = decode_json(raw)
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        for name in UNSUPPORTED:
            value = body.get(name)
            if not (value is None or value is False or (name in ("n", "best_of") and type(value) is int and value == 1)
                    or (name in ("tool_choice", "function_call") and value == "none")):
                raise APIError(400, f"'{name}' is not supported by this server", name)
        for name in UNSUPPORTED_PENALTIES:
            if _number(body, name, float, 0.0) != 0:
                raise APIError(400, f"'{name}' is not supported by this server (only 0)", name)
        model = body.get("model")
        if model not in (None, self.model_name):
            raise APIError(404, f"model {str(model)[:100]!r} not found; this server has {self.model_name!r}", "model",
                           "model_not_found")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise APIError(400, f"'stream' must be true or false, got {stream!r}"[:200], "stream")
        options = body.get("stream_options")  # (the last chunk always carries the usage: include_usage or not)
        if options is not None and (not isinstance(options, dict) or not stream):
            raise APIError(400, "'stream_options' must be an object, with 'stream': true", "stream_options")
        # (null is absent, as for every optional field: a null max_completion_tokens leaves max_tokens)
        limit = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = _number(body, limit, int, None, lo=1)
        temperature = _number(body, "temperature", float, 1.0, lo=0.0, hi=100.0)
        top_p = _number(body, "top_p", float, 1.0, lo=0.0, hi=1.0)
        top_k = _number(body, "top_k", int, 0, lo=0)
        seed = _number(body, "seed", int, None, *SEED_RANGE)
        try:
            check_sampling_args(temperature, top_k, top_p)
        except ValueError as err:
            raise APIError(400, str(err)) from None
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt or len(salt) > 256):
            raise APIError(400, "'cache_salt' must be a non-empty string of at most 256 characters", "cache_salt")
        stop = body.get("stop")
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
            raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
        ids = self._chat_ids(body) if chat else self._prompt_ids(body)
        room = self.engine.blocks.round_slots
        if max_tokens is None:  # OpenAI's defaults: what the context leaves (chat) / 16
            max_tokens = max(1, self.max_len - len(ids) + 2 - room) if chat else 16
        need = cache_need(len(ids), max_tokens, room)
        if need > self.max_len:
            raise APIError(400, f"the prompt ({len(ids)} tokens) with {limit} {max_tokens} needs {need} positions; "
                                f"this server holds {self.max_len} per request", limit, "context_length_exceeded")
        pool = self.engine.pool
        if self.engine.cache.blocks_for(need) > pool.num_blocks:  # it could never be admitted: not queued
            raise APIError(400, f"the prompt ({len(ids)} tokens) with {limit} {max_tokens} needs {need} positions; "
                                f"this server's KV pool holds {pool.num_blocks * pool.block_size} in all (--kv-memory)",
                           limit, "context_length_exceeded")
        seq = Sequence(ids, max_tokens, self.eos, temperature=temperature, top_k=top_k, top_p=top_p,
                       cache_namespace=None if tenant is None and salt is None else (tenant, salt), seed=seed)
        return seq, stop, bool(stream)

    def _prompt_ids(self, body: dict) -> list:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str) and prompt:
            self._check_chars(len(prompt), "prompt")
            return self.tokenizer(prompt).input_ids
        vocab = self.engine.target.config.vocab_size
        if isinstance(prompt, list) and prompt and set(map(type, prompt)) == {int} and 0 <= min(prompt) \
                and max(prompt) < vocab:
            return prompt
        raise APIError(400, "'prompt' must be one non-empty string or one list of token ids in the vocabulary",
                       "prompt")

    def _chat_ids(self, body: dict) -> list:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise APIError(400, "'messages' must be a non-empty list of {role, content} objects with text content",
                           "messages")
        if not self.tokenizer.chat_template:
            raise APIError(400, "this model's tokenizer has no chat template: use /v1/completions")
        # every text the template renders counts (a huge role was tokenised whole before its 400)
        self._check_chars(sum(len(m["content"]) + len(m["role"]) for m in messages), "messages")
        try:
            text = self.tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                                      add_generation_prompt=True, tokenize=False)
        except Exception as err:  # noqa: BLE001 - a template that refuses these messages (e.g. roles out of order)
            raise APIError(400, f"the chat template refused these messages: {err}"[:500], "messages") from None
        return self.pieces.encode(text)
