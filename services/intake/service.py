"""The intake's long-running part: the fleet client, the key table, limits and admission.

Owns one :class:`~streams.client.KvmeshClient` (the same SDK users call), the API key table, the
tokenizer, the metrics and the in-flight count. Invariant: ``in_flight <= settings.max_inflight``;
a request holds its slot from admission until its reply is fully sent or abandoned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from types import TracebackType

from kvmesh.tokenizer import Tokenizer, load_tokenizer
from schemas.messages import ChatRequest, SamplingParams
from services.intake.auth import ApiKeyTable
from services.intake.config import IntakeSettings
from services.intake.errors import (
    ContextTooLong,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    ServiceUnavailable,
)
from services.intake.metrics import IntakeMetrics
from services.intake.openai_models import ROLES, ChatCompletionRequest
from streams.client import KvmeshClient, RequestHandle

log = logging.getLogger("kvmesh.intake")


class IntakeService:
    """Validates, admits and submits chat requests; ``start()``/``stop()`` are safe twice."""

    def __init__(self, settings: IntakeSettings, tokenizer: Tokenizer | None = None) -> None:
        self.settings = settings
        self.tokenizer = tokenizer or load_tokenizer(settings.tokenizer_path)
        self.keys = ApiKeyTable.from_settings(settings)
        self.metrics = IntakeMetrics()
        self.client = KvmeshClient(
            settings.kafka,
            client_id=settings.intake_id,
            reply_topic=settings.reply_topic,
            block_size=settings.block_size,
            tokenizer=self.tokenizer,
            public_prefixes=settings.public_prefixes,
            model=settings.model_name,
        )
        self.in_flight = 0

    def __repr__(self) -> str:
        return f"IntakeService(intake_id={self.settings.intake_id!r}, in_flight={self.in_flight})"

    async def start(self) -> None:
        await self.client.start()
        log.info("intake %s connected to the fleet", self.settings.intake_id)

    async def stop(self) -> None:
        await self.client.stop()

    async def __aenter__(self) -> IntakeService:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- admission --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Hold one in-flight slot, or raise Overloaded (429 with Retry-After) when none is free."""
        if self.in_flight >= self.settings.max_inflight:
            raise Overloaded(
                f"Too many requests in flight on this intake (limit {self.settings.max_inflight}).",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        self.in_flight += 1
        self.metrics.in_flight.set(self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self.metrics.in_flight.set(self.in_flight)

    # -- validation -------------------------------------------------------------------------------
    def prepare(self, body: ChatCompletionRequest, *, tenant: str, session_hint: str | None) -> ChatRequest:
        """Check ``body`` against the deployment's limits and build the ChatRequest for ``tenant``."""
        s = self.settings
        if body.model != s.model_name:
            raise ModelNotFound(f"The model '{body.model}' does not exist.", param="model")
        if not body.messages:
            raise InvalidRequest("'messages' must contain at least one message.", param="messages")
        for i, m in enumerate(body.messages):
            if m.role not in ROLES:
                raise InvalidRequest(
                    f"Invalid role '{m.role}' in messages[{i}]; expected one of {', '.join(ROLES)}.",
                    param=f"messages[{i}].role",
                )
        if body.n not in (None, 1):
            raise InvalidRequest("Only n=1 is supported.", param="n")
        if body.stop:
            raise InvalidRequest("'stop' sequences are not supported.", param="stop")
        if not self.client.started:
            raise ServiceUnavailable("The intake is not connected to the fleet.")

        try:
            request = self.client.build_request(
                body.chat_messages(),
                session_id=self._session_id(tenant, session_hint),
                tenant=tenant,
                max_tokens=1,  # replaced below once the prompt length is known
                sampling=SamplingParams(
                    temperature=s.default_temperature if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    seed=body.seed,
                ),
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None

        prompt = len(request.token_ids)
        limit = s.tenant_max_prompt_tokens.get(tenant)
        if limit is not None and prompt > limit:
            raise ContextTooLong(
                f"The prompt has {prompt} tokens; this tenant's limit is {limit}.", param="messages"
            )
        room = s.max_context - prompt
        wanted = body.requested_max_tokens()
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        if wanted is not None and wanted > room:
            raise ContextTooLong(
                f"This model's maximum context length is {s.max_context} tokens. However, you requested "
                f"{prompt + wanted} tokens ({prompt} in the messages, {wanted} in the completion).",
                param=param,
            )
        if room < 1:
            raise ContextTooLong(
                f"This model's maximum context length is {s.max_context} tokens; the messages have {prompt}.",
                param="messages",
            )
        max_tokens = wanted if wanted is not None else min(s.default_max_tokens, room)
        # The fleet drops work nobody will wait for: the deadline is the intake's own timeout.
        deadline_ms = request.arrival_ms + int(s.request_timeout_s * 1000)
        return dataclasses.replace(request, max_tokens=max_tokens, deadline_ms=deadline_ms)

    @staticmethod
    def _session_id(tenant: str, hint: str | None) -> str | None:
        # Scoped by tenant: two tenants naming their conversations alike must not share a session.
        return f"{tenant}/{hint}" if hint else None

    async def submit(self, request: ChatRequest) -> RequestHandle:
        if not self.client.started:
            raise ServiceUnavailable("The intake is not connected to the fleet.")
        return await self.client.submit(request)
