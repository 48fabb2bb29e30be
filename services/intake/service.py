"""The intake's long-running part: the fleet client, the key table, limits and admission.

Owns one :class:`~kvmesh_client.KvmeshClient` (the same SDK users call), the API key table, the
tokenizer, the metrics and the in-flight count. Invariant: ``in_flight <= settings.max_inflight``;
a request holds its slot from admission until its reply is fully sent or abandoned.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Iterator
from types import TracebackType

import msgspec

from kvmesh_client import KvmeshClient, PublishTimeout, RequestHandle
from kvmesh_core.runtime import rolled_back_on_failure
from kvmesh_core.tokenizer import ChatMessage, Tokenizer, load_tokenizer, render_chat, supports_tools
from schemas.errors import RecordTooLarge, SchemaError
from schemas.messages import BASE_FEATURES, ChatRequest, SamplingParams, StructuredOutput
from schemas.report_signing import ReportCheck
from services.intake.auth import ApiKeyTable
from services.intake.capabilities import FeatureBoard, FeatureFeed
from services.intake.config import IntakeSettings
from services.intake.errors import (
    ContextTooLong,
    InvalidRequest,
    ModelNotFound,
    Overloaded,
    RequestTooLarge,
    ServiceUnavailable,
)
from services.intake.metrics import IntakeMetrics
from services.intake.openai_models import (
    ROLES,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from services.intake.sampling_fields import (
    FEATURE_PARAMS,
    LEGACY_DEFAULT_MAX_TOKENS,
    Prepared,
    completion_prompts,
    structured_output,
)
from services.intake.tools import ToolPlan, plan_tools, template_messages
from streams.consumer import ConsumerMetrics
from streams.consumer_metrics import ConsumerCollector
from streams.producer import PublishError

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
            publish_timeout_s=settings.publish_timeout_s,
        )
        self.in_flight = 0
        self.features = FeatureBoard(live_s=settings.worker_live_s, block_size=settings.block_size)
        self._feed = FeatureFeed(
            settings.kafka, self.features, ReportCheck.from_setting(settings.fleet_secret)
        )
        self.metrics.registry.register(
            ConsumerCollector(
                "intake", lambda: [self._consumer_metrics(self.client), self._consumer_metrics(self._feed)]
            )
        )

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """Whether a request sent now can be served, and why not: connected, the broker taking
        records, a live scheduler (its heartbeats) and a live worker of the served model (its
        LoadReports)."""
        model = self.settings.model_name
        now = time.monotonic()
        workers = len(self.features.live(model, now))
        schedulers = self.features.live_replicas("scheduler", now)
        checks: dict[str, object] = {
            "connected": self.client.started,
            "broker": self.client.publish_failures == 0,
            "live_workers": workers,
            "live_schedulers": len(schedulers),
        }
        ok = self.client.started and self.client.publish_failures == 0 and workers and schedulers
        return bool(ok), checks

    def __repr__(self) -> str:
        return f"IntakeService(intake_id={self.settings.intake_id!r}, in_flight={self.in_flight})"

    @staticmethod
    def _consumer_metrics(owner: object) -> ConsumerMetrics | None:
        consumer = getattr(owner, "_consumer", None)
        return consumer.metrics if consumer is not None else None

    async def start(self) -> None:
        async with rolled_back_on_failure(self.stop):
            await self.client.start()
            await self._feed.start()
        log.info("intake %s connected to the fleet", self.settings.intake_id)

    async def stop(self) -> None:
        await self._feed.stop()
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
    def prepare_chat(self, body: ChatCompletionRequest, *, tenant: str, session_hint: str | None) -> Prepared:
        """Check a chat body against the deployment and build its ChatRequests (one per choice)."""
        self._check_model(body.model)
        if not body.messages:
            raise InvalidRequest("'messages' must contain at least one message.", param="messages")
        for i, m in enumerate(body.messages):
            if m.role not in ROLES:
                raise InvalidRequest(
                    f"Invalid role '{m.role}' in messages[{i}]; expected one of {', '.join(ROLES)}.",
                    param=f"messages[{i}].role",
                )
            for j, part in enumerate(m.content if isinstance(m.content, list) else []):
                if part.type != "text":
                    raise InvalidRequest(
                        f"Content parts of type '{part.type}' are not supported; this model reads text.",
                        param=f"messages[{i}].content[{j}].type",
                        code="unsupported_value",
                    )
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequest("'top_logprobs' needs 'logprobs' set to true.", param="top_logprobs")
        tools = plan_tools(body)
        if tools is not None and not supports_tools(self.tokenizer):
            raise InvalidRequest(
                f"'tools' are not supported: the chat template of {body.model} does not render them.",
                param="tools",
                code="unsupported_parameter",
            )
        structured = structured_output(body.response_format)
        if tools is not None and tools.structured() is not None:
            if structured is not None:
                raise InvalidRequest(
                    "'response_format' cannot be combined with a 'tool_choice' that forces a call.",
                    param="response_format",
                )
            structured = tools.structured()
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        sampling = self._sampling(body, logprobs, structured, tools is not None)
        try:
            messages = [
                ChatMessage(role, text, tuple(calls)) for role, text, calls in template_messages(body)
            ]
            ids = render_chat(self.tokenizer, messages, tools=tools.tools if tools is not None else None)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="messages") from None
        param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        return self._build(
            body,
            [ids],
            sampling,
            tenant=tenant,
            session_hint=session_hint,
            max_tokens_param=param,
            default_max_tokens=self.settings.default_max_tokens,
            tools=tools,
        )

    def prepare_completion(
        self, body: CompletionRequest, *, tenant: str, session_hint: str | None
    ) -> Prepared:
        """Check a legacy completions body and build its ChatRequests (prompts x n choices)."""
        self._check_model(body.model)
        if body.best_of not in (None, 1, body.n or 1):
            raise InvalidRequest(
                "'best_of' other than n is not supported.", param="best_of", code="unsupported_value"
            )
        if body.echo and body.logprobs is not None:
            raise InvalidRequest(
                "'echo' with 'logprobs' needs prompt logprobs, which kvmesh does not compute.",
                param="echo",
                code="unsupported_value",
            )
        prompts = completion_prompts(body.prompt, self.tokenizer)
        structured = structured_output(body.response_format)
        sampling = self._sampling(body, body.logprobs, structured, False)
        return self._build(
            body,
            prompts,
            sampling,
            tenant=tenant,
            session_hint=session_hint,
            max_tokens_param="max_tokens",
            default_max_tokens=LEGACY_DEFAULT_MAX_TOKENS,
            tools=None,
            echo=bool(body.echo),
        )

    def _check_model(self, model: str) -> None:
        if model != self.settings.model_name:
            raise ModelNotFound(f"The model '{model}' does not exist.", param="model")
        if not self.client.started:
            raise ServiceUnavailable("The intake is not connected to the fleet.")

    def _sampling(
        self,
        body: SamplingFields,
        logprobs: int | None,
        structured: StructuredOutput | None,
        tools: bool,
    ) -> SamplingParams:
        s = self.settings
        try:
            sampling = SamplingParams(
                temperature=s.default_temperature if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                seed=body.seed,
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                min_tokens=body.min_tokens or 0,
                ignore_eos=bool(body.ignore_eos),
                logprobs=logprobs,
                stop=body.stop_list(),
                structured=structured,
            )
        except ValueError as exc:
            raise InvalidRequest(f"Invalid value for 'stop': {exc}.", param="stop") from None
        need = sampling.features() | ({"tools"} if tools else set())
        self._check_features(body.model, need)
        return sampling

    def _check_features(self, model: str, need: set[str]) -> None:
        """Refuse what the engines serving ``model`` do not honour (see capabilities.FeatureBoard)."""
        if not need:
            return
        have = self.features.features(model, time.monotonic())
        if have is None:
            if need <= set(BASE_FEATURES):
                return  # every kvmesh engine honours these; a worker that comes up will too
            raise ServiceUnavailable(
                f"No worker of {model} has announced what it supports yet; retry shortly.",
                headers={"Retry-After": str(self.settings.retry_after_s)},
            )
        missing = sorted(need - have)
        if missing:
            engines = ", ".join(self.features.engines(model, time.monotonic()))
            param = FEATURE_PARAMS.get(missing[0], missing[0])
            raise InvalidRequest(
                f"'{param}' is not supported by the engine serving {model} ({engines}).",
                param=param,
                code="unsupported_parameter",
            )

    def _build(
        self,
        body: SamplingFields,
        prompts: list[list[int]],
        sampling: SamplingParams,
        *,
        tenant: str,
        session_hint: str | None,
        max_tokens_param: str,
        default_max_tokens: int,
        tools: ToolPlan | None,
        echo: bool = False,
    ) -> Prepared:
        s = self.settings
        n = body.n or 1
        if n > s.max_n:
            raise InvalidRequest(f"'n' must be at most {s.max_n}.", param="n", code="unsupported_value")
        if n * len(prompts) > s.max_choices:
            raise InvalidRequest(
                f"{len(prompts)} prompts x n={n} exceeds the limit of {s.max_choices} choices.",
                param="n",
            )
        base = uuid.uuid4().hex
        session = self._session_id(tenant, session_hint or body.prompt_cache_key)
        wanted = body.requested_max_tokens()
        limit = s.tenant_max_prompt_tokens.get(tenant)
        requests: list[ChatRequest] = []
        for p, ids in enumerate(prompts):
            prompt = len(ids)
            if limit is not None and prompt > limit:
                raise ContextTooLong(
                    f"The prompt has {prompt} tokens; this tenant's limit is {limit}.", param="messages"
                )
            room = s.max_context - prompt
            if wanted is not None and wanted > room:
                raise ContextTooLong(
                    f"This model's maximum context length is {s.max_context} tokens. However, you "
                    f"requested {prompt + wanted} tokens ({prompt} in the prompt, {wanted} in the "
                    "completion).",
                    param=max_tokens_param,
                )
            if room < 1:
                raise ContextTooLong(
                    f"This model's maximum context length is {s.max_context} tokens; the prompt has "
                    f"{prompt}.",
                    param="messages",
                )
            max_tokens = wanted if wanted is not None else min(default_max_tokens, room)
            max_tokens = self._finishable(body.model, max_tokens, wanted is not None, max_tokens_param)
            for i in range(n):
                k = p * n + i
                # Choices of one prompt differ by seed (OpenAI: n samples, not n copies).
                seed = None if sampling.seed is None else _wrap_int64(sampling.seed + i)
                try:
                    req = self.client.build_request(
                        token_ids=ids,
                        session_id=session,
                        tenant=tenant,
                        max_tokens=max_tokens,
                        sampling=msgspec.structs.replace(sampling, seed=seed),
                        request_id=base if n * len(prompts) == 1 else f"{base}-{k}",
                        stop_token_ids=[self.tokenizer.end_id],
                    )
                except ValueError as exc:
                    raise InvalidRequest(str(exc), param="prompt") from None
                session = req.session_id  # one session for every choice (they share the prompt)
                # The fleet drops work nobody will wait for: the deadline is the intake's own timeout.
                deadline_ms = req.arrival_ms + int(s.request_timeout_s * 1000)
                requests.append(msgspec.structs.replace(req, deadline_ms=deadline_ms))
        return Prepared(
            id=base,
            requests=requests,
            prompt_count=len(prompts),
            n=n,
            tools=tools,
            echo=[self.tokenizer.decode(ids) for ids in prompts] if echo else [],
        )

    def _finishable(self, model: str, max_tokens: int, explicit: bool, param: str) -> int:
        """``max_tokens`` if the fleet's fastest worker can decode that many before the deadline.

        A request that cannot finish would hold a worker until its 504; an explicit ``max_tokens``
        like that is refused, a default one is lowered to what can finish."""
        step_ms = self.features.fastest_decode_ms(model, time.monotonic())
        if step_ms is None:
            return max_tokens
        budget = max(1, int(self.settings.request_timeout_s * 1000 / step_ms))
        if max_tokens <= budget:
            return max_tokens
        if not explicit:
            return budget
        raise InvalidRequest(
            f"'{param}' of {max_tokens} cannot finish within the request timeout of "
            f"{self.settings.request_timeout_s:g} s: the fastest worker of {model} decodes a token in "
            f"{step_ms:.1f} ms, so at most {budget} tokens fit.",
            param=param,
            code="unsupported_value",
        )

    @staticmethod
    def _session_id(tenant: str, hint: str | None) -> str | None:
        # Scoped by tenant: two tenants naming their conversations alike must not share a session.
        return f"{tenant}/{hint}" if hint else None

    async def submit(self, request: ChatRequest) -> RequestHandle:
        """Publish one choice; what can go wrong here is a status, never a 500."""
        if not self.client.started:
            raise ServiceUnavailable("The intake is not connected to the fleet.")
        retry = {"Retry-After": str(self.settings.retry_after_s)}
        try:
            return await self.client.submit(request)
        except RecordTooLarge as exc:
            raise RequestTooLarge(f"The request is too large for the fleet: {exc}.") from None
        except SchemaError as exc:
            raise InvalidRequest(f"The request cannot be encoded: {exc}.") from None
        except (PublishTimeout, PublishError) as exc:
            log.warning("request %s not published: %s", request.request_id, exc)
            raise ServiceUnavailable(
                "The fleet's broker is not reachable; retry shortly.", headers=retry
            ) from None


def _wrap_int64(seed: int) -> int:
    """``seed`` folded into int64, the range every engine's generator takes (choice seeds are seed + i)."""
    return (seed + 2**63) % 2**64 - 2**63
