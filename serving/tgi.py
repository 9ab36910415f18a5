"""The TGI / LMI request shape and its translation to and from an OpenAI completion.

Pure functions on parsed JSON, no engine and no I/O: they run on the event loop for
every TGI request and must stay cheap. ``{"inputs": "...", "parameters": {...},
"stream": bool}`` is served as an OpenAI completion by vLLM and translated back.

A TGI request answers ``{"generated_text": ..., "details": {...}}`` (``details`` when
asked, with per-token log-probabilities), or, streamed, TGI's server-sent events
``data: {"token": {...}, "generated_text": null, "details": null}``; the last event
carries ``generated_text``.
"""

from __future__ import annotations

import json
from typing import Any, Iterator, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

TGI_DEFAULT_MAX_NEW_TOKENS = 100


class TgiParameters(BaseModel):
    """TGI's ``parameters`` (plus LMI's ``stop_sequences``); unknown names are errors."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)
    repetition_penalty: Optional[float] = Field(None, gt=0)
    frequency_penalty: Optional[float] = Field(None, ge=-2, le=2)
    presence_penalty: Optional[float] = Field(None, ge=-2, le=2)
    seed: Optional[int] = None
    stop: Optional[Union[list[str], str]] = None
    stop_sequences: Optional[list[str]] = None
    do_sample: Optional[bool] = None
    return_full_text: bool = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: Optional[int] = Field(None, ge=0, le=20)
    truncate: Optional[int] = Field(None, ge=1)
    ignore_eos: bool = False
    # vLLM's per-request cache salt: the prompt's cached KV is shared only with requests
    # that carry the same salt (the tiered cache keys by it too).
    cache_salt: Optional[str] = Field(None, min_length=1)
    # vLLM's per-request connector options, e.g. a pin: {"kvcache_pin_ttl": 3600}
    # (serving.cache_control).
    kv_transfer_params: Optional[dict[str, Any]] = None


class TgiRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    inputs: str = Field(min_length=1)
    # Set by SageMaker's inference-component adapter header (X-Amzn-SageMaker-Adapter-
    # Identifier, through the standards library), or by the client: a LoRA adapter's name.
    model: Optional[str] = None
    parameters: TgiParameters = Field(default_factory=TgiParameters)
    stream: bool = False


def parse_tgi(body: dict) -> TgiRequest:
    """The TGI request; a pydantic ``ValidationError`` (400) when it is not one."""
    return TgiRequest.model_validate(body)


def tgi_to_completion(req: TgiRequest, model: str) -> dict:
    """The OpenAI completion body that serves a TGI request."""
    p = req.parameters
    stops = ([p.stop] if isinstance(p.stop, str) else list(p.stop or [])) + list(p.stop_sequences or [])
    body: dict[str, Any] = {
        "model": req.model or model,
        "prompt": req.inputs,
        "max_tokens": p.max_new_tokens or TGI_DEFAULT_MAX_NEW_TOKENS,
        "stream": req.stream,
        "return_token_ids": True,
        "ignore_eos": p.ignore_eos,
    }
    if req.stream:
        body["stream_options"] = {"include_usage": True}
    greedy = p.do_sample is False and p.temperature is None
    if greedy:
        body["temperature"] = 0.0
    for name in (
        "temperature",
        "top_p",
        "top_k",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "seed",
    ):
        value = getattr(p, name)
        if value is not None and not (greedy and name == "temperature"):
            body[name] = value
    if stops:
        body["stop"] = stops
    if p.details or req.stream or p.top_n_tokens:
        body["logprobs"] = p.top_n_tokens or 0  # the sampled token's log-probability (+ top n)
    if p.decoder_input_details:
        body["prompt_logprobs"] = 0
    if p.truncate:
        body["truncate_prompt_tokens"] = p.truncate
    if p.cache_salt:
        body["cache_salt"] = p.cache_salt
    if p.kv_transfer_params:
        body["kv_transfer_params"] = p.kv_transfer_params
    return body


def _finish_reason(reason: Optional[str], stop_reason: Any) -> Optional[str]:
    if reason == "length":
        return "length"
    if reason == "stop":
        return "stop_sequence" if stop_reason is not None else "eos_token"
    return reason


def _tokens(choice: dict, ids: list) -> tuple[list[dict], list[list[dict]]]:
    """TGI token records (and top tokens) of one completion choice or stream chunk."""
    lp = choice.get("logprobs") or {}
    texts = lp.get("tokens") or []
    values = lp.get("token_logprobs") or []
    tops = lp.get("top_logprobs") or []
    tokens, top_tokens = [], []
    for i, tid in enumerate(ids):
        tokens.append(
            {
                "id": tid,
                "text": texts[i] if i < len(texts) else "",
                "logprob": values[i] if i < len(values) else None,
                "special": False,
            }
        )
        top = tops[i] if i < len(tops) and tops[i] else {}
        top_tokens.append([{"id": None, "text": t, "logprob": v, "special": False} for t, v in top.items()])
    if ids and not texts:  # no logprobs asked: the text belongs to the last token
        tokens[-1]["text"] = choice.get("text", "")
    return tokens, top_tokens


def completion_to_tgi(resp: dict, req: TgiRequest) -> dict:
    """A TGI/LMI answer from an OpenAI completion response (dict)."""
    choice = resp["choices"][0]
    text = choice.get("text", "")
    out: dict[str, Any] = {"generated_text": (req.inputs + text) if req.parameters.return_full_text else text}
    p = req.parameters
    if p.details or p.decoder_input_details or p.top_n_tokens:
        ids = choice.get("token_ids") or []
        tokens, top_tokens = _tokens(choice, ids)
        details: dict[str, Any] = {
            "finish_reason": _finish_reason(choice.get("finish_reason"), choice.get("stop_reason")),
            "generated_tokens": len(ids),
            "seed": p.seed,
            "prefill": [],
            "tokens": tokens,
        }
        if p.top_n_tokens:
            details["top_tokens"] = top_tokens
        if p.decoder_input_details:
            details["prefill"] = _prefill(choice)
        out["details"] = details
    return out


def _prefill(choice: dict) -> list[dict]:
    ids = choice.get("prompt_token_ids") or []
    lps = choice.get("prompt_logprobs") or []
    out = []
    for i, tid in enumerate(ids):
        entry = lps[i] if i < len(lps) else None
        rec = (entry or {}).get(str(tid)) or (entry or {}).get(tid) if entry else None
        out.append({"id": tid, "text": (rec or {}).get("decoded_token", ""), "logprob": (rec or {}).get("logprob")})
    return out


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class TgiStream:
    """Turns vLLM's completion stream (``data: {...}`` strings) into TGI events.

    Holds back one token event so the last one can carry ``generated_text`` and
    ``details``, as TGI's last event does. An error event ends the stream: the held-back
    token goes out before it, and nothing after it (no last event with partial text).
    """

    def __init__(self, req: TgiRequest) -> None:
        self.req = req
        self.text: list[str] = []
        self.generated = 0
        self.pending: Optional[dict] = None
        self.finish: Optional[str] = None
        self.failed = False

    def feed(self, chunk: str) -> Iterator[str]:
        for line in chunk.splitlines():
            if self.failed:
                return
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                continue
            try:
                data = json.loads(payload)
            except json.JSONDecodeError:
                continue
            if "error" in data:
                err = data["error"]
                msg = err.get("message") if isinstance(err, dict) else str(err)
                if self.pending is not None:  # the tokens generated so far, then the error
                    yield sse(self.pending)
                yield sse(
                    {
                        "error": msg,
                        "error_type": (err or {}).get("type", "generation") if isinstance(err, dict) else "generation",
                    }
                )
                self.failed, self.pending = True, None
                return
            for choice in data.get("choices") or []:
                yield from self._choice(choice)

    def _choice(self, choice: dict) -> Iterator[str]:
        ids = choice.get("token_ids") or []
        self.text.append(choice.get("text", ""))
        tokens, _ = _tokens(choice, ids)
        if not ids and choice.get("text") and self.pending is not None:
            self.pending["token"]["text"] += choice["text"]  # text flushed without a new token
        for tok in tokens:
            if self.pending is not None:
                yield sse(self.pending)
            self.generated += 1
            self.pending = {"token": tok, "generated_text": None, "details": None}
        if choice.get("finish_reason"):
            self.finish = _finish_reason(choice["finish_reason"], choice.get("stop_reason"))

    def close(self) -> Iterator[str]:
        """The last event, with the whole text and details (none after an error)."""
        if self.failed:
            return
        last = self.pending or {"token": {"id": None, "text": "", "logprob": None, "special": True}}
        text = "".join(self.text)
        last["generated_text"] = (self.req.inputs + text) if self.req.parameters.return_full_text else text
        last["details"] = {
            "finish_reason": self.finish,
            "generated_tokens": self.generated,
            "seed": self.req.parameters.seed,
        }
        self.pending = None
        yield sse(last)
