"""RetryAction: what a strategy decided (RFC 0049 "Retry Strategies")."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import attrs

from ._context import ErrorContext
from ._duration import MAX_SECONDS, to_seconds
from ._errors import CouchbaseException
from ._untrusted import show

__all__ = ["ExceptionFactory", "RetryAction"]

#: Builds the exception the caller gets when a request is not retried.
ExceptionFactory = Callable[[ErrorContext], BaseException]


def _factory_for(exc: type[CouchbaseException] | ExceptionFactory) -> ExceptionFactory:
    if isinstance(exc, type):
        if not issubclass(exc, CouchbaseException):
            raise TypeError(
                "RetryAction.no_retry(exception=...) takes a CouchbaseException subclass or a "
                f"callable (ErrorContext) -> BaseException, got the class {exc.__name__}"
            )
        cls = exc

        def build(context: ErrorContext) -> BaseException:
            return cls(context=context)

        build.__qualname__ = f"build_{cls.__name__}"
        return build
    if not callable(exc):
        raise TypeError(
            "RetryAction.no_retry(exception=...) takes a CouchbaseException subclass or a "
            f"callable (ErrorContext) -> BaseException, got {exc!r}"
        )
    return exc


@attrs.frozen(slots=True, repr=False)
class RetryAction:
    """Retry after ``duration``, or (``duration is None``) do not retry.

    Build one with :meth:`with_duration` or :meth:`no_retry`. A refusal may carry
    the exception the caller gets instead of the default
    :class:`RequestCanceledException` (the Java SDK's "exception translator").
    """

    duration: timedelta | None
    #: When refusing: builds the exception raised to the caller from the request's
    #: ErrorContext. ``None`` means RequestCanceledException (NO_MORE_RETRIES). A
    #: CouchbaseException subclass given here is turned into such a builder.
    exception: ExceptionFactory | None = attrs.field(default=None, eq=False)
    #: When refusing: why, in the strategy's own words (``retry.not_retried``'s ``detail``).
    why: str | None = attrs.field(default=None, eq=False, kw_only=True)
    # What the caller chose (the class or the callable): refusals compare equal when
    # they would raise the same kind of exception.
    _chosen: object = attrs.field(init=False, repr=False)
    #: ``duration`` in seconds (None for a refusal), computed once.
    seconds: float | None = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        duration = self.duration
        chosen = self.exception
        why = self.why
        if why is not None and not isinstance(why, str):
            raise TypeError(f"RetryAction(why=...) must be a str or None, got {why!r}")
        seconds: float | None
        if duration is None:
            seconds = None
            if chosen is not None:
                object.__setattr__(self, "exception", _factory_for(chosen))
        else:
            if not isinstance(duration, timedelta):
                raise TypeError(
                    "RetryAction(duration) must be a datetime.timedelta or None, got "
                    f"{duration!r}; use RetryAction.with_duration() for seconds"
                )
            if chosen is not None:
                raise ValueError(
                    f"RetryAction(exception=...): only a refusal (duration=None) takes an "
                    f"exception, got exception={show(chosen)} with duration={duration!r}; "
                    "refuse with RetryAction.no_retry(exception) instead"
                )
            if why is not None:
                raise ValueError(
                    f"RetryAction(why=...): only a refusal (duration=None) takes why, got "
                    f"why={show(why)} with duration={duration!r}; "
                    "refuse with RetryAction.no_retry(why=...) instead"
                )
            seconds = duration.total_seconds()
            if seconds < 0:
                raise ValueError(f"RetryAction(duration) must be >= 0 seconds, got {duration!r}")
        object.__setattr__(self, "_chosen", chosen)
        object.__setattr__(self, "seconds", seconds)

    @classmethod
    def with_duration(cls, duration: timedelta | float) -> RetryAction:
        """Retry after ``duration`` (a ``timedelta`` or seconds, >= 0)."""
        if type(duration) is float and 0.0 <= duration <= MAX_SECONDS:  # the common case
            return cls(timedelta(seconds=duration))
        seconds = to_seconds(duration, "RetryAction.with_duration(duration)")
        if not isinstance(duration, timedelta):
            duration = timedelta(seconds=seconds)
        return cls(duration)

    @classmethod
    def no_retry(
        cls,
        exception: type[CouchbaseException] | ExceptionFactory | None = None,
        *,
        why: str | None = None,
    ) -> RetryAction:
        """Do not retry; fail the request.

        ``exception`` chooses what the caller gets: a CouchbaseException subclass
        (built with the request's context) or a callable taking the ErrorContext and
        returning an exception. ``None`` gives RequestCanceledException (NO_MORE_RETRIES).
        ``why``: the strategy's reason in its own words, logged as ``detail`` on
        ``retry.not_retried`` (e.g. ``"all 4 attempts (maxAttempts) used"``).
        """
        if exception is None and why is None:
            return _NO_RETRY
        return cls(None, exception, why=why)

    @property
    def retries(self) -> bool:
        """True when this action asks for a retry."""
        return self.duration is not None

    def __repr__(self) -> str:
        if self.duration is None:
            chosen = self._chosen
            name = getattr(chosen, "__qualname__", None) if chosen is not None else None
            return f"RetryAction.no_retry({name or ''})"
        return f"RetryAction.with_duration({self.duration!r})"


_NO_RETRY = RetryAction(None)
