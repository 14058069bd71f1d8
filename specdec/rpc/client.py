"""A small Python client for the public ``specdec.v1.Generation`` API (for backend services).

    from specdec.rpc.client import SpecdecClient

    with SpecdecClient("127.0.0.1:50051") as client:
        out = client.generate("def fib(n):", max_tokens=64, stop=["\\n\\n"])
        print(out.text, out.finish_reason, out.stats["acceptance_rate"])
        for chunk in client.generate_stream("def fib(n):", max_tokens=64):
            print(chunk.text, end="", flush=True)

With TLS or a bearer token on the server, pass :class:`specdec.rpc.client_credentials.ClientCredentials`
(``credentials=ClientCredentials.load(token_file="token", ca="ca.pem")``); by default the client
sends the token in ``$SPECDEC_API_TOKEN`` when that is set, over plaintext.

Errors come back as :class:`specdec.rpc.client_errors.SpecdecError` (a ``grpc.RpcError`` with
``code()`` and ``details()``), one subclass per common code, carrying the server's status details:

    try:
        client.generate("def fib(n):", top_p=2.0)
    except InvalidArgument as exc:
        print(exc.field, exc.field_violations)     # "top_p", [FieldViolation("top_p", "must be in (0, 1] ...")]
    except (ResourceExhausted, Unavailable) as exc:
        time.sleep(exc.retry_delay or 1.0)          # the server's estimate (google.rpc.RetryInfo)

grpc is allowed here (specdec/rpc); torch is not imported.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.rpc import generate_pb2, generate_pb2_grpc
from specdec.rpc.client_credentials import ClientCredentials
from specdec.rpc.client_errors import (
    DeadlineExceeded,
    FieldViolation,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    SpecdecError,
    Unavailable,
    from_rpc_error,
)
from specdec.rpc.convert import mode_to_proto, spec_mode_to_proto
from specdec.rpc.grpc_options import channel_options

__all__ = [
    "SpecdecClient",
    "ClientCredentials",
    "GenerateResult",
    "StreamChunk",
    "TokenizeResult",
    "build_request",
    "chat_messages",
    "SpecdecError",
    "FieldViolation",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "Unavailable",
    "DeadlineExceeded",
]


def usage_dict(u: generate_pb2.Usage) -> dict[str, int]:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens}


def model_dict(m: generate_pb2.ModelInfo) -> dict[str, Any]:
    """One ListModels entry as the clients return it."""
    return {
        "name": m.name,
        "role": m.role,
        "dtype": m.dtype,
        "device": m.device,
        "max_context": m.max_context,
        "ready": m.ready,
        "vocab_size": m.vocab_size,
        "eos_token_ids": list(m.eos_token_ids),
        "has_chat_template": m.has_chat_template,
    }


def tokenize_request(
    prompt: str | None,
    prompt_token_ids: Sequence[int] | None,
    messages: Sequence[Message] | None,
    model: str,
    chat: bool,
) -> generate_pb2.TokenizeRequest:
    return generate_pb2.TokenizeRequest(
        model=model,
        prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids or []),
        messages=chat_messages(messages),
        chat=chat,
    )


def stats_dict(s: generate_pb2.SpeculationStats) -> dict[str, Any]:
    """SpeculationStats as the core's ``RequestStats.as_dict()`` (the local CLI's JSON)."""
    return {
        "rounds": s.rounds,
        "drafted": s.drafted,
        "accepted": s.accepted,
        "acceptance_rate": round(s.acceptance_rate, 4),
        "fail_open_rounds": s.fail_open_rounds,
        "accepted_per_position": list(s.accepted_per_position),
        "drafted_per_position": list(s.drafted_per_position),
    }


@dataclass
class GenerateResult:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    usage: dict[str, int]
    stats: dict[str, Any]

    @classmethod
    def from_proto(cls, r: generate_pb2.GenerateResponse) -> GenerateResult:
        return cls(
            r.request_id,
            r.text,
            list(r.token_ids),
            r.finish_reason,
            usage_dict(r.usage),
            stats_dict(r.speculation),
        )


@dataclass
class StreamChunk:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # set on the last chunk
    usage: dict[str, int] | None = None
    stats: dict[str, Any] | None = None
    time: float = field(default_factory=time.perf_counter)  # when the chunk arrived (perf_counter)

    @classmethod
    def from_proto(cls, c: generate_pb2.GenerateChunk) -> StreamChunk:
        last = bool(c.finish_reason)
        return cls(
            c.request_id,
            c.text,
            list(c.token_ids),
            c.finish_reason or None,
            usage_dict(c.usage) if last else None,
            stats_dict(c.speculation) if last else None,
        )


@dataclass
class TokenizeResult:
    token_ids: list[int]
    count: int


Message = tuple[str, str] | dict[str, str]  # (role, content) or {"role": ..., "content": ...}


def chat_messages(messages: Sequence[Message] | None) -> list[generate_pb2.ChatMessage]:
    """A conversation as ChatMessage protos (GenerateRequest.messages, TokenizeRequest.messages)."""
    out = []
    for m in messages or ():
        role, content = (m["role"], m["content"]) if isinstance(m, dict) else m
        out.append(generate_pb2.ChatMessage(role=role, content=content))
    return out


def build_request(
    prompt: str | None = None,
    *,
    prompt_token_ids: Sequence[int] | None = None,
    messages: Sequence[Message] | None = None,
    model: str = "",
    chat: bool = False,
    max_tokens: int = 0,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    mode: str | None = None,
    k: int = 0,
    verify_mode: str | None = None,
    request_id: str = "",
) -> generate_pb2.GenerateRequest:
    """A GenerateRequest; None / 0 / empty leave the server's defaults."""
    speculation = generate_pb2.SpeculationOptions(
        mode=spec_mode_to_proto(mode), k=k, verify_mode=mode_to_proto(verify_mode)
    )  # raise InvalidParams (a ValueError) for an unknown mode
    req = generate_pb2.GenerateRequest(
        request_id=request_id,
        model=model,
        prompt=prompt or "",
        prompt_token_ids=list(prompt_token_ids or []),
        messages=chat_messages(messages),
        chat=chat,
        max_tokens=max_tokens,
        top_k=top_k,
        stop=list(stop),
        stop_token_ids=list(stop_token_ids),
        ignore_eos=ignore_eos,
        speculation=speculation,
    )
    if temperature is not None:
        req.temperature = temperature
    if top_p is not None:
        req.top_p = top_p
    if seed is not None:
        req.seed = seed
    return req


def _structured_errors(call) -> Iterator:
    try:
        yield from call
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


class SpecdecClient:
    """Blocking client of one specdec router (``host:port``); thread-safe like a gRPC channel."""

    def __init__(
        self,
        address: str,
        *,
        timeout: float | None = None,
        wait_ready: float | None = 10.0,
        credentials: ClientCredentials | None = None,
    ):
        self.address = address
        self.timeout = timeout
        self.credentials = credentials if credentials is not None else ClientCredentials.load()
        self.channel = self.credentials.channel(address, channel_options(64 << 20))
        self.stub = generate_pb2_grpc.GenerationStub(self.channel)
        if wait_ready:
            try:
                grpc.channel_ready_future(self.channel).result(timeout=wait_ready)
            except grpc.FutureTimeoutError:
                self.channel.close()
                hint = "; with TLS, check the CA and client certificate" if self.credentials.secure else ""
                raise ConnectionError(
                    f"no specdec server answers at {address} (waited {wait_ready:.0f} s{hint})"
                ) from None

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> GenerateResult:
        """One completion (see :func:`build_request` for the parameters)."""
        req = build_request(prompt, **kwargs)
        try:
            return GenerateResult.from_proto(self.stub.Generate(req, timeout=self._timeout(timeout)))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def generate_stream(
        self, prompt: str | None = None, *, timeout: float | None = None, **kwargs
    ) -> Iterator[StreamChunk]:
        """Committed chunks as they come; the last has finish_reason, usage and stats. Closing the
        iterator early cancels the request (its KV slots are freed)."""
        req = build_request(prompt, **kwargs)
        call = self.stub.GenerateStream(req, timeout=self._timeout(timeout))
        try:
            for c in _structured_errors(call):
                yield StreamChunk.from_proto(c)
        finally:
            call.cancel()  # no-op when finished

    def list_models(self, timeout: float | None = 10.0) -> list[dict[str, Any]]:
        try:
            resp = self.stub.ListModels(generate_pb2.ListModelsRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return [model_dict(m) for m in resp.models]

    def tokenize(
        self,
        prompt: str | None = None,
        *,
        prompt_token_ids: Sequence[int] | None = None,
        messages: Sequence[Message] | None = None,
        model: str = "",
        chat: bool = False,
        timeout: float | None = 30.0,
    ) -> TokenizeResult:
        """The prompt's token ids exactly as :meth:`generate` would run them, and their count."""
        req = tokenize_request(prompt, prompt_token_ids, messages, model, chat)
        try:
            resp = self.stub.Tokenize(req, timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return TokenizeResult(list(resp.token_ids), resp.count)

    def health(self, service: str = "", timeout: float | None = 10.0) -> str:
        """grpc.health.v1 status name ("SERVING", "NOT_SERVING", ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> SpecdecClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
