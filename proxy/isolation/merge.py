"""Every pod's isolation verdicts as one: a case's tallies summed over the pods that saw its requests.

Isolation needs no fan-out (each pod isolates the requests it serves), so a cluster-scope read
only adds up what each pod's `/cache/state` says (`isolation.open` and `isolation.closed`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from proxy.isolation.tally import CaseTally
from proxy.vocabulary import IsolationResult

__all__ = ["merged_isolation"]

_COUNTED = (
    IsolationResult.COLD,
    IsolationResult.CONTRADICTED,
    IsolationResult.UNOBSERVABLE,
    IsolationResult.REFUSED,
)


def merged_isolation(pods: Iterable[tuple[str, Any]]) -> list[dict[str, Any]]:
    """Per (session_id, case_id): the pods, the summed counts and the verdict over all of them.

    `pods` is (pod name, that pod's `/cache/state` member `isolation`); a pod without one
    (an older sidecar) adds nothing.
    """
    tallies: dict[tuple[Any, Any], CaseTally] = {}
    seen_on: dict[tuple[Any, Any], list[str]] = {}
    contradicted: set[tuple[Any, Any]] = set()
    for pod, isolation in pods:
        if not isinstance(isolation, dict):
            continue
        for entry in (*isolation.get("open", ()), *isolation.get("closed", ())):
            if not isinstance(entry, dict):
                continue
            key = (entry.get("session_id"), entry.get("case_id"))
            tally = tallies.setdefault(key, CaseTally(key[0], key[1], from_ns=0))
            for result in _COUNTED:
                count = entry.get(result.value)
                if isinstance(count, int) and count > 0:
                    tally.counts[result] = tally.counts.get(result, 0) + count
            if entry.get("verdict") == IsolationResult.CONTRADICTED:
                contradicted.add(key)  # by a request, or by that pod's engine counters
            pods_of = seen_on.setdefault(key, [])
            if pod not in pods_of:
                pods_of.append(pod)
    merged = []
    for key, tally in tallies.items():
        summary = tally.summary()
        del summary["from_ns"], summary["counters"]
        if key in contradicted:
            summary["verdict"] = IsolationResult.CONTRADICTED.value
        merged.append({**summary, "pods": seen_on[key]})
    return merged
