"""The one reading of a single reset call's response, shared by the dialects that make one call.

vLLM, SGLang, mindnano and a configured generic route differ only in facts: which
statuses mean "busy, retry", which mean "not served", and whether a 2xx body must say
`success`. Those facts are data (`ResponseRules`); the order of the questions is here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.engines.base import Attempt, failed_attempt, outcome_for_status, success_field, unsupported
from proxy.engines.call import Reply
from proxy.vocabulary import ResetAnswer

__all__ = ["ResponseRules", "read_response"]


@dataclass(frozen=True)
class ResponseRules:
    """What one engine's reset response means, status by status."""

    route: str  # the reset route, named when it is not served
    hint: str  # how to get the route served, for an `unsupported` attempt
    busy: Mapping[int, str] = field(default_factory=dict)  # status -> why it is a refusal to retry
    unsupported: frozenset[int] = frozenset({404})
    rejected: Mapping[int, tuple[str, str | None]] = field(default_factory=dict)  # status -> error, hint
    success_field: str | None = None  # None: any 2xx acknowledges; else the body must say it
    unconfirmed_warning: str | None = None  # a 2xx whose body does not have the field


def read_response(reply: Reply, rules: ResponseRules) -> Attempt:
    """The attempt one reset call made: no response, busy, not served, rejected, other non-2xx, then the 2xx."""
    status, url, calls = reply.status, reply.call.url, (reply.call,)
    if status is None:
        return failed_attempt(reply, url)
    if status in rules.busy:
        error = f"HTTP {status} ({rules.busy[status]})"
        return Attempt(ResetAnswer.REFUSED, status=status, success=False, error=error, url=url, calls=calls)
    if status in rules.unsupported:
        return unsupported(url, f"HTTP {status}: {rules.route} is not served", rules.hint, calls)
    if status in rules.rejected:
        error, hint = rules.rejected[status]
        return Attempt(ResetAnswer.ERROR, status=status, error=error, url=url, calls=calls, hint=hint)
    if not 200 <= status < 300:
        outcome, error = outcome_for_status(status)
        return Attempt(outcome, status=status, error=error, url=url, calls=calls)
    if rules.success_field is None:
        return Attempt(ResetAnswer.ACKNOWLEDGED, status=status, success=True, url=url, calls=calls)
    # As the reference client does: only `true` is a yes, another value a refusal, no field unconfirmed.
    success = success_field(reply.json(), rules.success_field)
    if success is True:
        return Attempt(ResetAnswer.ACKNOWLEDGED, status=status, success=True, url=url, calls=calls)
    if success is False:
        error = f"{rules.success_field} false"
        return Attempt(ResetAnswer.REFUSED, status=status, success=False, error=error, url=url, calls=calls)
    return Attempt(
        ResetAnswer.ACCEPTED_UNVERIFIED,
        status=status,
        url=url,
        calls=calls,
        warning=rules.unconfirmed_warning,
    )
