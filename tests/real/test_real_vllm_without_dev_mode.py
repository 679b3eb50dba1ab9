"""The sidecar in front of a real vLLM started without VLLM_SERVER_DEV_MODE (a short-lived engine)."""

from __future__ import annotations

import aiohttp

from tests.real.conftest import Pair
from tests.real.sidecar_client import new_case, reset
from tests.support.client import CLIENT_TIMEOUT


async def test_reset_without_dev_mode_is_unsupported_with_hint(vllm_without_dev_mode: Pair) -> None:
    """vLLM's 404 for /reset_prefix_cache becomes 501 unsupported, and the hint names dev mode."""
    session_id, case_id = new_case()
    async with aiohttp.ClientSession(timeout=CLIENT_TIMEOUT) as s:
        status, answer = await reset(s, vllm_without_dev_mode.url, session_id=session_id, case_id=case_id)
    assert status == 501, answer
    assert answer["answer"] == "unsupported" and answer["success"] is False
    assert answer["engine"]["kind"] == "vllm"
    assert "VLLM_SERVER_DEV_MODE=1" in answer["hint"]
