"""`/v1/*` is served by `ApiHandler`: the API's views without the admin's browser middleware
(sessions, CSRF, messages, clickjacking), which under ASGI cost every request twelve hand-overs
between threads. The security headers stay; the admin keeps its whole stack."""

from __future__ import annotations

import asyncio

import httpx


def test_api_answers_keep_the_security_headers_and_skip_the_browser_middleware(shared_platform) -> None:
    models = httpx.get(f"{shared_platform.base_url}/v1/models", headers=shared_platform.headers, timeout=30)
    assert models.status_code == 200
    assert models.headers["X-Content-Type-Options"] == "nosniff"
    assert models.headers["Referrer-Policy"] == "same-origin"
    # what only the admin's chain adds (clickjacking protection) is not on an API answer
    assert "X-Frame-Options" not in models.headers
    # the one page under /v1 is still kept out of frames, and renders without sessions
    docs = httpx.get(f"{shared_platform.base_url}/v1/docs", timeout=30)
    assert docs.status_code == 200 and docs.headers["X-Frame-Options"] == "DENY"
    missing = httpx.get(f"{shared_platform.base_url}/v1/nothing-here", headers=shared_platform.headers)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert missing.headers["X-Content-Type-Options"] == "nosniff"


def test_the_admin_keeps_its_whole_stack(shared_platform) -> None:
    with httpx.Client(base_url=shared_platform.base_url, timeout=30) as browser:
        login = browser.get("/admin/login/")
        assert login.status_code == 200
        assert login.headers["X-Frame-Options"] == "DENY"
        assert "csrftoken" in browser.cookies
        # a form post without its CSRF token is still refused
        forged = browser.post("/admin/login/", data={"username": "a", "password": "b"})
        assert forged.status_code == 403


def test_the_api_chain_runs_on_the_event_loop() -> None:
    from inference_platform.api.handler import ApiHandler

    handler = ApiHandler()
    assert asyncio.iscoroutinefunction(handler._middleware_chain)
    assert handler._view_middleware == []  # no process_view hook to adapt to a thread
