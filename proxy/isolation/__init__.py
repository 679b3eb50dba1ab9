"""Cold by construction: requests isolated from the engine's prefix cache, each proven cold.

decision.py  the request header that asks for it
rules.py     each engine's isolation member, route and version, as data
rewrite.py   the member written into the body byte-wise (a fresh salt, or `false`)
tally.py     one request's result, one case's tally and its record
cases.py     the isolated cases and the open tallies (`Isolation`)
"""

from proxy.isolation.cases import Isolation
from proxy.isolation.decision import ISOLATION_HEADER, BadIsolationHeader, header_asks
from proxy.isolation.rewrite import Unrewritable, isolated_body, isolated_request
from proxy.isolation.rules import IsolationRule, rule_for
from proxy.isolation.tally import request_result

__all__ = [
    "ISOLATION_HEADER",
    "BadIsolationHeader",
    "Isolation",
    "IsolationRule",
    "Unrewritable",
    "header_asks",
    "isolated_body",
    "isolated_request",
    "request_result",
    "rule_for",
]
