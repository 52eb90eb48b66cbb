"""RetryOrchestrator: the doors onto one retry rule (RFC 0049 "Retry Orchestration").

How a failed attempt flows, on every door (rfc/0001, "Layers and modules"):

    door (execute / maybe_retry / attempt / execute_sync / hedge / the gRPC channels)
      -> the strategy's answer            OrchestratorCore._ask (sdkcore._core)
      -> decide(...) -> (Verdict, delay)  sdkcore._decision   (pure)
      -> book it on the Request           sdkcore._retry_state (its transitions)
      -> wait, or raise the final error   sdkcore._runtime / sdkcore._failing

The doors themselves live in :mod:`sdkcore._execute` (async), :mod:`sdkcore._execute_sync`
(threads) and :mod:`sdkcore._hedge` (hedging: its copies are timed by the HedgePolicy,
and the strategy is only asked whether a failure may be hedged past); this class binds
them by name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from . import _execute, _execute_sync, _failing
from ._context import AttemptEffect
from ._core import DEFAULT_MAX_REQUESTS_IN_RETRY, OrchestratorCore
from ._errors import CouchbaseException, final_effect
from ._hedge import check_hedge, run_hedged
from ._reason import suggest_member
from ._request import Request, RequestState

if TYPE_CHECKING:  # imported at their first use (sdkcore.HedgePolicy), see sdkcore._hedge
    from ._hedge_policy import HedgePolicy, HedgeThrottler

__all__ = ["DEFAULT_MAX_REQUESTS_IN_RETRY", "RetryOrchestrator"]

T = TypeVar("T")


class RetryOrchestrator(OrchestratorCore):
    """Decides, for each failed attempt, whether and when a request is retried.

    * ``default_strategy``: used for requests whose ``retry_strategy`` is None
      (default: :class:`FastFailOnTerminalErrorRetryStrategy`). An sdkcore gRPC
      channel's calls do not use it: each is retried by its method's A6 policy
      (``A6RetryStrategy``, rfc/0003).
    * ``max_requests_in_retry``: backpressure; beyond this many requests waiting
      in retry, further retries fail at once (TOO_MANY_REQUESTS_IN_RETRY).
    * ``sleep``: the wait (default: the running event loop's own sleep); inject a
      virtual clock's sleep in tests together with ``Request(clock=...)``.
    * ``retry_budget``: an :class:`RetryBudget` shared by every request (and any
      other orchestrator or channel given the same one): each request's first
      attempt deposits, each retry that sends again withdraws, and a refused
      withdrawal ends the request (RETRY_BUDGET_EXHAUSTED). See rfc/0007.
    * ``telemetry``: an :class:`sdkcore.Telemetry`: every request of this
      orchestrator, on every door, reports its metrics and spans there (rfc/0008);
      None (the default) records nothing.

    Three doors, one set of rules: :meth:`execute` (async dispatch loop),
    :meth:`execute_sync` (the same for threads), and :meth:`maybe_retry` with
    :meth:`attempt`, :meth:`succeed` and :meth:`fail` for a hand-wired loop; plus
    :meth:`hedge` for hedged requests.
    """

    __slots__ = ()

    execute = _execute.execute
    execute_sync = _execute_sync.execute_sync
    maybe_retry = _execute.maybe_retry
    attempt = _execute.attempt

    def succeed(self, request: Request) -> None:
        """Mark ``request`` as succeeded (for hand-wired dispatch loops; ``execute`` does it).

        A completed request cannot be retried; this does nothing if it already completed.
        """
        if not isinstance(request, Request):
            raise TypeError(
                f"succeed(request): request must be an sdkcore.Request, got {request!r}"
            )
        pending = request.state is RequestState.PENDING
        request._succeeded()
        trace = request._trace
        if trace is None and pending and self._telemetry is not None:
            trace = self._telemetry.begin(request)  # a loop without attempt() that never failed
        if trace is not None:
            trace.end(request, None)

    def fail(
        self,
        request: Request,
        error: BaseException,
        *,
        effect: AttemptEffect | None = None,
    ) -> BaseException:
        """Fail ``request`` with ``error`` (a non-retryable answer); returns ``error`` to raise.

        For hand-wired loops, to match :meth:`succeed`: the attempt is recorded
        (``last_error``), the request completes as failed, and a CouchbaseException
        without a context gets the request's. ``raise orchestrator.fail(request, exc)``.
        ``effect``: what is known of the attempt on the server; by default the error's own
        (:attr:`CouchbaseException.effect`, as the KV mapper sets it), else it may have
        been applied (nothing proves otherwise); ``AttemptEffect.NOT_APPLIED`` for an
        answer that proves it was not (a replace answered "not found"), ``NOT_SENT``
        for a failure before anything was written. It is what the error's context
        (``attempts``) and ``Request.maybe_applied`` report.
        Given the caller's cancellation (a BaseException that is not an Exception), the
        request completes CANCELLED (``TASK_CANCELLED``) and no attempt is recorded, as
        when the cancellation cuts ``execute``. Does not complete a request that already
        completed.
        """
        if not isinstance(request, Request):
            raise TypeError(
                f"fail(request, error): request must be an sdkcore.Request, got {request!r}"
            )
        if not isinstance(error, BaseException):
            raise TypeError(f"fail(request, error): error must be an exception, got {error!r}")
        if effect is None:
            effect = final_effect(error, request.id)
        elif type(effect) is not AttemptEffect:
            raise TypeError(
                f"fail(effect=...) must be an AttemptEffect or None, got {effect!r}"
                + suggest_member(effect, AttemptEffect)
            )
        pending = request.state is RequestState.PENDING
        if pending:
            if isinstance(error, Exception):
                request._attempt_failed(None, effect, error, request.clock())
            # The caller's cancellation (or another BaseException) ends it CANCELLED
            # (TASK_CANCELLED), as on every other door: it is no answer of an attempt.
            _failing.finish_by(request, error)
        if isinstance(error, CouchbaseException) and error.context is None:
            error.context = request.error_context(request.last_reason)
        trace = request._trace
        if trace is None and pending and self._telemetry is not None:
            trace = self._telemetry.begin(request)  # a loop without attempt() or a retry
        if trace is not None:
            trace.end(request, error)
        return error

    async def hedge(
        self,
        request: Request,
        send: Callable[[Request, int], Awaitable[T]],
        policy: HedgePolicy,
        *,
        throttler: HedgeThrottler | None = None,
    ) -> T:
        """Send copies of an idempotent ``request`` ahead of failures; return the first success.

        ``send(request, index)`` sends hedge ``index`` (0 for the first; an SDK may
        send hedge ``i`` to another replica). The first attempt goes at once, the
        next after each ``policy.delay`` without an answer, up to
        ``policy.max_attempts`` (capped). The first result wins and every other
        attempt is cancelled; its result is returned. ``RetryableError`` with a
        non-fatal reason sends the next hedge at once (or after the pushback), unless
        the request's strategy refuses to retry that reason (its synchronous
        ``decide``: e.g. a terminal error under the default strategy, which then ends
        the request with its mapped exception). A ``RetryableError`` with a fatal
        reason (not in ``policy.non_fatal``) ends the chain: every other copy is
        cancelled and ``RequestCanceledException`` (NO_MORE_RETRIES) is raised, the
        error its ``__cause__``; any exception other than ``RetryableError`` cancels
        everything and propagates. When every copy failed,
        ``RequestCanceledException`` (NO_MORE_RETRIES) is raised for the *last*
        failure to arrive (its ``__cause__``); RETRY_BUDGET_EXHAUSTED when the retry
        budget refused the next copy. The request's timeout covers the
        whole chain (``UnambiguousTimeoutException``). ``throttler`` (e.g.
        ``sdkcore.grpc.RetryThrottler``) gates every hedge after the first.
        A request that is not idempotent is refused (InvalidArgumentException)
        and nothing is sent. Error contexts list every hedge under ``extra``.
        """
        telemetry = self._telemetry
        if telemetry is None or request._trace is not None:
            return await run_hedged(self, request, send, policy, throttler)
        # Refused before the trace begins: a bad argument or a completed request records
        # nothing (rfc/0008), as on the other doors. run_hedged checks again (cheap).
        check_hedge(request, send, policy, throttler)
        trace = telemetry.begin(request)
        try:
            result = await run_hedged(
                self,
                request,
                trace.traced_hedge(send) if callable(send) else send,
                policy,
                throttler,
            )
        except BaseException as exc:
            trace.end(request, exc)
            raise
        trace.end(request, None)
        return result
