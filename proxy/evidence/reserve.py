"""Which observations of the open case the resets file keeps, where observation traffic cannot
rotate them away (proxy/evidence/log.py): the case's own requests, within a reserve per reset.

A reset opens a case; its requests are told apart by its case token (which no other client
has) or, failing that, by the session and case ids the reset named (which any client can send,
so they get a reserve of their own: a forger can fill that one, never the token's). Each reserve
holds CASE_RESERVE observations (~770 B each): at most ~200 KB per reset, and only admin calls
reset, so the resets file still fills at the admin's pace, never the traffic's.
"""

from __future__ import annotations

from proxy.observe import Observation

__all__ = ["CASE_RESERVE", "CaseReserve"]

CASE_RESERVE = 128


class CaseReserve:
    """The open case (the last accepted reset) and how much of each of its reserves is taken."""

    def __init__(self, size: int = CASE_RESERVE) -> None:
        """No case open yet."""
        self.size = size
        self._ids: tuple[str | None, str | None] | None = None  # (session_id, case_id) it named
        self._own = 0  # observations kept that carried the case token
        self._tagged = 0  # observations kept that carried the case's ids only

    def opened(self, session_id: str | None, case_id: str | None) -> None:
        """An accepted reset opens a case (and closes the one before: its reserve is spent)."""
        self._ids = (session_id, case_id) if case_id is not None else None
        self._own = self._tagged = 0

    def keeps(self, observation: Observation) -> bool:
        """Whether `observation` is the open case's and fits its reserve (its place is then taken).

        The case token is the open reset's alone (the witness checks it); ids are whatever the
        client sent, so a request of an earlier case with the same ids counts as this one's.
        """
        if observation.case_token_carried:
            if self._own >= self.size:
                return False
            self._own += 1
            return True
        if self._ids is None or (observation.session_id, observation.case_id) != self._ids:
            return False
        if self._tagged >= self.size:
            return False
        self._tagged += 1
        return True
