"""The retry machinery of one channel: options, per-method plans, the replay buffer budget.

:class:`RetryController` (in ``_interceptors``) adds the interceptors on top of
this class; the call modules (``_unary``, ``_streaming``, ``_hedging``) only read
what it holds.
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from grpc import aio

from .. import _log
from .._callables import sync_callable
from .._latency import LatencyQuantile
from .._orchestrator import RetryOrchestrator
from .._telemetry import Telemetry, watched_by
from .._untrusted import show as _show
from ._gate import Gate
from ._metadata import (
    DEFAULT_CHANNEL_BUFFER_LIMIT,
    DEFAULT_PER_CALL_BUFFER_LIMIT,
    _truthy,
    default_message_size,
)
from ._plans import HedgePlan, _method_name, _Plan
from ._policy import A6RetryStrategy, BackoffJitter
from ._service_config import DEFAULT_MAX_ATTEMPTS_CAP, ServiceConfig
from ._stats import MAX_METHODS, RetryStats
from ._telemetry import ChannelTelemetry
from ._throttle import RetryThrottler, _nothing
from ._throttle import _acquire as _acquire_throttler

_OPT_SERVICE_CONFIG = "grpc.service_config"
_OPT_ENABLE_RETRIES = "grpc.enable_retries"
_OPT_NO_RESOLVED_CONFIG = "grpc.service_config_disable_resolution"


def _config_ignored(target: str, config: ServiceConfig) -> None:
    """``grpc.config_ignored``: the channel's service config has keys nothing applies (a
    typo A6 ignores, ``perAttemptRecvTimeout``), said once, when its controller is made
    (rfc/0003, "Config events"); ``sdkcore check-config`` says the same of a file."""
    log = _log.enabled(_log.WARNING)
    if log is None:
        return
    ignored = config._ignored
    log.warning(
        _log.EVENT_GRPC_CONFIG_IGNORED,
        target=target,
        ignored=[
            {"path": key.path, "suggestion": key.suggestion, "why": key.why}
            for key in ignored[: _log.GRPC_CONFIG_IGNORED_SHOWN]
        ],
        count=len(ignored),
    )


def channel_closed_error() -> Exception:
    """What grpc.aio raises for a call made on a closing channel: a new call made while
    ``close(grace)`` waits for sdkcore's calls (:meth:`_Controller._drain`; grpc.aio's
    channel is still open then) is refused with it too."""
    return aio.UsageError("Channel is closed.")  # type: ignore[no-any-return]


class _Controller:
    """The retry machinery shared by one channel's calls (see :class:`RetryController`).

    * ``service_config``: a :class:`ServiceConfig` (or its JSON / a Mapping); None
      means no retry policies (transparent retries only). It is never handed to
      grpcio: grpc C-core runs no retry policy of its own on these channels. Keys
      nothing applies (A6 ignores unknown keys: ``retryPolicyy``) are logged once, when
      the controller is made, as the warning ``grpc.config_ignored`` (rfc/0003).
    * ``target``: the server name; picks the process-wide throttler.
    * ``orchestrator``: the :class:`RetryOrchestrator` every retry goes through.
    * ``enabled``: False turns every kind of retry off (A6 "Disabling Retries").
    * ``max_attempts_cap``: the client cap on maxAttempts (A6 default 5).
    * ``backoff_jitter``: :class:`BackoffJitter` (the 2017 text or the 2024 amendment).
    * ``per_call_buffer_limit`` / ``channel_buffer_limit``: replay buffer limits in bytes.
    * ``transparent_retries``: A6 transparent retries of attempts the channel's
      ``limiter``/``throttle`` refused (they never left the client), and the check that
      books an attempt that found no connection as not sent (needs :meth:`bind_channel`;
      such an attempt fails fast to the retry policy either way, as grpcio's; rfc/0003,
      "Fail fast").
    * ``stats``: a :class:`RetryStats` to record into (a new one by default).
    * ``message_size``: bytes of a request message (default :func:`default_message_size`).
    * ``limiter`` / ``throttle``: an :class:`sdkcore.ConcurrencyLimiter` (or
      :class:`sdkcore.AdaptiveConcurrencyLimiter`) / :class:`sdkcore.AdaptiveThrottle`
      for the channel's target, taken around every attempt of every call shape (rfc/0009).
    * ``telemetry``: an :class:`sdkcore.Telemetry` for the gRPC metrics and spans (A66,
      A96, A72; rfc/0008); None: the orchestrator's (``orchestrator.telemetry``), if any.
      Given with an orchestrator that has another one: ValueError.
    """

    def __init__(
        self,
        target: str,
        service_config: ServiceConfig | str | bytes | Any | None = None,
        *,
        orchestrator: RetryOrchestrator | None = None,
        enabled: bool = True,
        max_attempts_cap: int = DEFAULT_MAX_ATTEMPTS_CAP,
        backoff_jitter: BackoffJitter = BackoffJitter.FULL,
        per_call_buffer_limit: int = DEFAULT_PER_CALL_BUFFER_LIMIT,
        channel_buffer_limit: int = DEFAULT_CHANNEL_BUFFER_LIMIT,
        transparent_retries: bool = True,
        transparent_retry_limit: int = 10,
        stats: RetryStats | None = None,
        message_size: Callable[[Any], int] | None = None,
        telemetry: Telemetry | None = None,
        hedge_delay: Callable[[str], LatencyQuantile | None] | None = None,
        limiter: Any = None,
        throttle: Any = None,
    ) -> None:
        # Every argument is checked before any shared state (the process-wide
        # throttler of the target) is touched: a rejected controller changes nothing.
        if not isinstance(target, str):
            raise TypeError(
                f"RetryController(target) must be a str (the server name), got {target!r}"
            )
        if not target.strip():
            raise ValueError(
                "RetryController(target) must be a non-empty server name "
                f'(e.g. "localhost:50051" or "dns:///host:443"), got {_show(target)}'
            )
        if service_config is not None and not isinstance(service_config, ServiceConfig):
            if not isinstance(service_config, (str, bytes, bytearray, Mapping)):
                raise TypeError(
                    "service_config must be a ServiceConfig, its JSON (str or bytes) or a "
                    f"Mapping of it, or None, got {_show(service_config)} "
                    f"({type(service_config).__name__})"
                )
            service_config = ServiceConfig.from_json(service_config)
        for name, value in (
            ("per_call_buffer_limit", per_call_buffer_limit),
            ("channel_buffer_limit", channel_buffer_limit),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"RetryController({name}=...) must be an integer >= 0 bytes, got {_show(value)}"
                )
        for name, value in (("enabled", enabled), ("transparent_retries", transparent_retries)):
            if not isinstance(value, bool):
                raise TypeError(f"RetryController({name}=...) must be a bool, got {_show(value)}")
        if not isinstance(backoff_jitter, BackoffJitter):
            raise TypeError(
                "RetryController(backoff_jitter=...) must be a BackoffJitter (FULL or "
                f"PROPORTIONAL), got {backoff_jitter!r}"
            )
        if stats is not None and not isinstance(stats, RetryStats):
            raise TypeError(f"RetryController(stats=...) must be a RetryStats, got {stats!r}")
        sync_callable(
            message_size, "RetryController(message_size=...)", "(message) -> bytes", optional=True
        )
        if hedge_delay is not None and not callable(hedge_delay):
            raise TypeError(
                "RetryController(hedge_delay=...) must be a callable (method name) -> "
                f"LatencyQuantile | None, or None, got {_show(hedge_delay)}"
            )
        #: The channel's limiter and throttle (None: neither), around every attempt.
        gate = None if limiter is None and throttle is None else Gate(limiter, throttle)
        if telemetry is not None and not isinstance(telemetry, Telemetry):
            raise TypeError(
                "RetryController(telemetry=...) must be an sdkcore.Telemetry or None, "
                f"got {telemetry!r}"
            )
        if orchestrator is not None and not isinstance(orchestrator, RetryOrchestrator):
            raise TypeError(
                "RetryController(orchestrator=...) must be an sdkcore.RetryOrchestrator or None, "
                f"got {orchestrator!r}"
            )
        if orchestrator is not None:
            theirs = getattr(orchestrator, "telemetry", None)
            if telemetry is None:
                telemetry = theirs
            elif theirs is not None and theirs is not telemetry:
                raise ValueError(
                    "telemetry: the channel was given one Telemetry and its orchestrator has "
                    "another; give it to one of them (RetryOrchestrator(telemetry=...) or the "
                    "channel's telemetry=...), or the same object to both"
                )
        # max_attempts_cap and transparent_retry_limit, with the strategy's own messages.
        A6RetryStrategy(
            None,
            max_attempts_cap=max_attempts_cap,
            jitter=backoff_jitter,
            transparent_retry_limit=transparent_retry_limit,
        )
        self.target = target
        self.service_config: ServiceConfig | None = service_config
        self.orchestrator = (
            orchestrator if orchestrator is not None else RetryOrchestrator(telemetry=telemetry)
        )
        #: The telemetry the channel's calls record into (None: nothing is recorded).
        self.telemetry = telemetry
        self._tel: ChannelTelemetry | None = (
            None if telemetry is None else ChannelTelemetry(telemetry, target, service_config)
        )
        self.enabled = enabled
        self.stats = stats if stats is not None else RetryStats()
        self.per_call_buffer_limit = per_call_buffer_limit
        self.channel_buffer_limit = channel_buffer_limit
        self.transparent_retries = transparent_retries and enabled
        self.message_size = message_size or default_message_size
        self._buffered = 0
        self._buffer_lock = threading.Lock()
        if telemetry is not None:  # the channel's limiter and throttle report through it,
            for shedder in (limiter, throttle):  # unless the application watches them elsewhere
                if shedder is not None and watched_by(shedder) is None:
                    telemetry.watch(shedder)
        throttling = None if service_config is None else service_config.retry_throttling
        self.throttler: RetryThrottler | None = None
        self._abandon: Callable[[], None] = _nothing
        if throttling is not None and enabled:  # last: the one shared state a controller changes
            self.throttler, self._abandon = _acquire_throttler(
                target, throttling.max_tokens, throttling.token_ratio
            )
        self._strategy_args: dict[str, Any] = {
            "throttler": self.throttler,
            "max_attempts_cap": max_attempts_cap,
            "jitter": backoff_jitter,
            "transparent_retry_limit": transparent_retry_limit,
        }
        self._plans: dict[Any, _Plan | None] = {}
        self._hedge_plans: dict[Any, HedgePlan | None] = {}
        self._hedge_delay = hedge_delay
        self.gate: Gate | None = gate
        self._channel: weakref.ref[Any] | None = None
        #: The calls waiting between attempts (sdkcore's backoff, a transparent retry's
        #: delay, a hedged call's later copies): objects whose ``cancel()`` ends them
        #: as the application's ``call.cancel()`` does. Closing the channel cancels them.
        self._waiting: set[Any] = set()
        #: True once the channel helper's channel stopped taking attempts (at ``close()``,
        #: or once ``close(grace)``'s wait is over): no call waits then.
        self._closing = False
        #: True while ``close(grace)`` waits for sdkcore's calls (:meth:`_drain`; rfc/0003,
        #: "Closing the channel"): they still retry and hedge, and the channel refuses new
        #: calls itself (grpc.aio's channel is still open). ``_closing`` follows.
        self._draining = False
        #: sdkcore's calls that may still send an attempt: a unary or streaming call's
        #: state until it ends (or its stream commits: ``_Call.release``), a hedged call
        #: until it ends. ``close(grace)`` waits for them (:meth:`_drain`).
        self._live: set[Any] = set()
        #: Set when ``_live`` empties while :meth:`_drain` waits (made by it), or when the
        #: channel stops taking attempts (:meth:`_close_calls`).
        self._drained: asyncio.Event | None = None
        if service_config is not None and service_config._ignored:
            _config_ignored(target, service_config)

    # -- the channel ----------------------------------------------------------------
    def channel_options(
        self, options: Sequence[tuple[str, Any]] | None = None
    ) -> list[tuple[str, Any]]:
        """``options`` plus what grpc C-core needs on a channel that uses these interceptors.

        grpc C-core never gets a retry policy: a ``grpc.service_config`` option is
        refused (pass ``service_config=`` instead) and resolver-provided configs are
        ignored (``grpc.service_config_disable_resolution`` 1); what C-core applies
        itself (load balancing, message size limits) reaches it as that option, without
        the parts sdkcore runs (``ServiceConfig.for_grpc``, rfc/0003). Its retry filter is
        off (``grpc.enable_retries`` 0) unless ``options`` asks for it with
        ``("grpc.enable_retries", 1)``: then C-core also does A6 transparent retries
        of streams the server never saw, but it replaces the
        ``grpc-previous-rpc-attempts`` header of every attempt, so servers no
        longer see sdkcore's retry count (rfc/0003). That opt-in needs retries and
        transparent retries on. Raises ValueError for a conflicting option.
        """
        native = 0
        out: list[tuple[str, Any]] = []
        for item in options or ():
            try:
                key, value = item
            except (TypeError, ValueError):
                raise ValueError(
                    f"channel options must be (key, value) pairs, got {item!r}"
                ) from None
            if key == _OPT_SERVICE_CONFIG:
                raise ValueError(
                    f"the {_OPT_SERVICE_CONFIG!r} channel option is not allowed on an sdkcore "
                    "channel: grpc C-core would run its own retries with it. Pass the config "
                    "as service_config=... instead."
                )
            if key == _OPT_ENABLE_RETRIES:
                if _truthy(value) and not self.transparent_retries:
                    raise ValueError(
                        f"channel option ({key!r}, {value!r}) conflicts with "
                        "retries_enabled=False / transparent_retries=False: it would turn "
                        "grpc C-core's transparent retries on"
                    )
                native = 1 if _truthy(value) else 0
                continue
            if key == _OPT_NO_RESOLVED_CONFIG:
                if not _truthy(value):
                    raise ValueError(
                        f"channel option ({key!r}, {value!r}) is not allowed on an sdkcore "
                        "channel: a service config from the name resolver could give grpc "
                        "C-core a retry policy of its own (sdkcore sets it to 1)"
                    )
                continue
            out.append((key, value))
        out.append((_OPT_ENABLE_RETRIES, native))
        out.append((_OPT_NO_RESOLVED_CONFIG, 1))
        config = self.service_config
        if config is not None and config.for_grpc is not None:
            # what grpc C-core applies itself: load balancing, message size limits
            out.append((_OPT_SERVICE_CONFIG, config.for_grpc))
        return out

    def bind_channel(self, channel: Any) -> None:
        """Tell the controller which channel its interceptors run on.

        The channel helpers do this. It lets the interceptor see the channel's
        connectivity state, which is what recognises "no connection could be
        made": the attempt then goes to the retry policy booked as not sent
        (rfc/0003, "Fail fast"); without it, as maybe applied.
        """
        self._channel = weakref.ref(channel)

    def _connectivity(self) -> Any:
        ref = self._channel
        channel = None if ref is None else ref()
        if channel is None:
            return None
        try:
            return channel.get_state(try_to_connect=False)
        except Exception:  # a closed channel, or an object without get_state
            return None

    def _close_calls(self) -> None:
        """The channel stops taking attempts: cancel every call waiting between attempts,
        and every hedged call whose runner has started.

        grpc.aio refuses new calls once its ``close()`` starts and cancels the calls it
        tracks (each attempt in flight). A call waiting in sdkcore's backoff has no
        attempt in flight, so grpc.aio does not see it: it is cancelled here, the way
        grpc.aio ends a call in flight (``await`` raises ``asyncio.CancelledError``,
        ``code()`` is CANCELLED). A call whose attempt fails later, while the channel
        closes, ends the same way instead of waiting (``_Call.failed``). Called as
        ``close()`` starts, or once :meth:`_drain` is over for ``close(grace)``.
        """
        self._closing = True
        self._draining = False
        drained = self._drained
        if drained is not None:  # a close(grace) still waiting: nothing left to wait for
            drained.set()
        waiting = list(self._waiting)
        self._waiting.clear()
        for call in waiting:
            call.cancel()

    async def _drain(self, grace: float) -> float:
        """``close(grace)`` with a grace above 0, before grpc.aio's close: refuse new calls
        and let sdkcore's calls retry and hedge until none may send another attempt, or
        until the grace is over; returns the grace left for grpc.aio's close.

        grpcio's own retries and hedges live inside one C-core call, which its close lets
        finish within the grace; sdkcore's attempts are separate grpc.aio calls, which
        grpc.aio refuses once its close starts. So the channel stays open while this
        waits, and refuses new calls itself (``UsageError``, as grpc.aio does).
        """
        loop = asyncio.get_running_loop()
        start = loop.time()
        self._draining = True
        if self._live:
            drained = self._drained
            if drained is None:
                drained = self._drained = asyncio.Event()
            try:
                if grace == math.inf:
                    await drained.wait()
                else:
                    await asyncio.wait_for(drained.wait(), grace)
            except asyncio.TimeoutError:
                pass  # the grace is over: the calls still live are cancelled
        return max(grace - (loop.time() - start), 0.0)

    def _stopped_sending(self, call: Any) -> None:
        """Note that ``call`` (in :attr:`_live`) sends no attempt more."""
        live = self._live
        live.discard(call)
        if not live:
            drained = self._drained
            if drained is not None:
                drained.set()

    # -- per-method plans ------------------------------------------------------
    def plan(self, method: Any) -> _Plan | None:
        """The plan for a method (bytes or str), or None when nothing is retried."""
        try:
            return self._plans[method]
        except KeyError:
            pass
        name = _method_name(method)
        mc = None if self.service_config is None else self.service_config.method_config(name)
        policy = mc.retry_policy if mc is not None and self.enabled else None
        plan: _Plan | None = None
        # With retries off, a method config's timeout / waitForReady still apply; with
        # throttling, every successful call feeds the throttler (A6), policy or not.
        # With telemetry every call is observed: a method sdkcore would leave to grpc.aio
        # gets a plan that never retries (nothing else changes for it).
        if (
            policy is not None
            or self._tel is not None
            or self.transparent_retries
            or self.throttler is not None
            or self.gate is not None
            or (mc is not None and (mc.timeout is not None or mc.wait_for_ready is not None))
        ):
            plan = _Plan(A6RetryStrategy(policy, **self._strategy_args), mc, name)
        # Bounded as RetryStats is (each plan ~0.9 KiB with its strategy): a channel calling
        # more methods (a gateway forwarding any path) builds a further one's plan per call.
        if len(self._plans) < MAX_METHODS:
            self._plans[method] = plan
        return plan

    def hedge_plan(self, method: Any) -> HedgePlan | None:
        """The hedging plan of ``method`` (bytes or str), or None when it is not hedged."""
        try:
            return self._hedge_plans[method]
        except KeyError:
            pass
        name = _method_name(method)
        config = self.service_config
        mc = None if config is None or not self.enabled else config.method_config(name)
        plan = None
        if mc is not None and mc.hedging_policy is not None:
            learned = None if self._hedge_delay is None else self._hedge_delay(name)
            if learned is not None and not isinstance(learned, LatencyQuantile):
                raise TypeError(
                    f"RetryController(hedge_delay=...) returned {_show(learned)} for {name}: "
                    "a LatencyQuantile or None (the service config's hedgingDelay) is needed"
                )
            if learned is not None and self.telemetry is not None and watched_by(learned) is None:
                # reports its delay (sdkcore.hedge.delay) as the channel's limiter and
                # throttle do, labelled by target and method, unless watched elsewhere
                self.telemetry.watch(learned, name=f"{self.target}{name}")
            plan = HedgePlan(
                mc,
                max_attempts_cap=self._strategy_args["max_attempts_cap"],
                throttler=self.throttler,
                name=name,
                delay=learned,
            )
        if len(self._hedge_plans) < MAX_METHODS:
            self._hedge_plans[method] = plan
        return plan

    # -- channel-wide replay buffer ------------------------------------------------
    @property
    def buffered_bytes(self) -> int:
        """Bytes currently held for replay by all calls of the channel."""
        return self._buffered

    def _hold(self, size: int) -> bool:
        """Take a whole request of ``size`` bytes into the retry buffer if it fits both the
        per-call limit and the channel's room left (give it back with :meth:`_release`);
        False: it does not, and such a call is not retried or hedged (A6)."""
        return size <= self.per_call_buffer_limit and self._reserve(size)

    def _reserve(self, size: int) -> bool:
        with self._buffer_lock:
            if self._buffered + size > self.channel_buffer_limit:
                return False
            self._buffered += size
            return True

    def _release(self, size: int) -> None:
        if size:
            with self._buffer_lock:
                self._buffered -= size
