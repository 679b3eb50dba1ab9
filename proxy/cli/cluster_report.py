"""What `cachewitness reset|evidence --scope cluster` prints: a per-pod table, the worst pod's exit code."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from proxy.vocabulary import EventType

__all__ = ["pod_table", "unreadable_pods", "worst_exit_code"]


def worst_exit_code(
    answer: Mapping[str, Any], code_of: Callable[[Mapping[str, Any]], int], failed: int
) -> int:
    """The highest of the pods' exit codes (`code_of` one pod's entry); `failed` when there is no pod at all."""
    pods = [pod for pod in answer.get("pods") or [] if isinstance(pod, dict)]
    if not pods:
        return failed
    return max(code_of(pod) for pod in pods)


def pod_table(answer: Mapping[str, Any]) -> str:
    """One line for the cluster, then one row per pod: pod, HTTP status, answer, verified, reset_id, error."""
    head = f"cluster {answer.get('answer')}: reset_id {answer.get('reset_id')}, peers from {answer.get('peers_source')}"
    for key in ("detail", "hint"):
        if answer.get(key):
            head += f"; {key}: {answer[key]}"
    header = ("pod", "status", "answer", "verified", "reset_id", "error")
    rows = [header]
    for pod in answer.get("pods") or []:
        rows.append(
            (
                str(pod.get("pod")),
                str(pod.get("status") if pod.get("status") is not None else "-"),
                str(pod.get("answer")),
                str(pod.get("verified") or "-"),
                str(pod.get("reset_id") or "-"),
                str(pod.get("error") or ""),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    table = "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )
    return f"{head}\n{table}"


def unreadable_pods(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """`pod (error)` for each pod a merged-evidence trailing line names as unreadable."""
    named: list[str] = []
    for record in records:
        if record.get("event_type") == EventType.CLUSTER_READ:
            named += [f"{pod.get('pod')} ({pod.get('error')})" for pod in record.get("unreadable") or []]
    return named
