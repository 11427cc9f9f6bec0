"""The few GitHub REST calls the PR bot needs, through httpx, with retries and clear errors.

The token comes from the caller (``GITHUB_TOKEN``) and is never logged or echoed: error
messages carry the method, path and status only.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx

from k3fasttrack.errors import InfrastructureError, UsageError

DEFAULT_API = "https://api.github.com"
RETRIES = 5


class GitHubAuthError(UsageError):
    """401/403/404: a token, permission or name problem the user must fix."""


@dataclass(frozen=True)
class Comment:
    """An issue comment as far as the bot cares."""

    id: int
    author: str
    body: str


_ADVICE = {
    401: "the token was rejected (expired or wrong): check GITHUB_TOKEN",
    403: "the token lacks permission: it needs 'issues: write' or 'pull-requests: write'",
    404: "not found: check --repo OWNER/NAME and --pr, and that the token can see the repo",
}


def _is_rate_limited(resp: httpx.Response) -> bool:
    if resp.status_code == 429:
        return True
    if resp.status_code != 403:
        return False
    return (resp.headers.get("x-ratelimit-remaining") == "0" or "retry-after" in resp.headers
            or "rate limit" in resp.text.lower())


def _wait_seconds(resp: httpx.Response, attempt: int) -> float:
    if "retry-after" in resp.headers:
        return float(resp.headers["retry-after"])
    reset = resp.headers.get("x-ratelimit-reset")
    if reset and resp.headers.get("x-ratelimit-remaining") == "0":
        return max(0.0, float(reset) - time.time())
    return min(60.0, 2.0 ** attempt)


class GitHub:
    """A minimal client for issue comments."""

    def __init__(self, token: str, api: str | None = None,
                 sleep: Callable[[float], None] = time.sleep, timeout: float = 30) -> None:
        self._sleep = sleep
        self._client = httpx.Client(
            base_url=(api or os.environ.get("GITHUB_API_URL") or DEFAULT_API).rstrip("/"),
            headers={"Authorization": f"Bearer {token}", "Accept": "application/vnd.github+json",
                     "X-GitHub-Api-Version": "2022-11-28", "User-Agent": "k3ft-pr-bot"},
            timeout=timeout)

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()

    def _request(self, method: str, url: str, **kw: Any) -> httpx.Response:
        for attempt in range(RETRIES + 1):
            try:
                resp = self._client.request(method, url, **kw)
            except httpx.TransportError as exc:
                if attempt == RETRIES:
                    raise InfrastructureError(f"GitHub {method} {url}: {type(exc).__name__}") \
                        from None
                self._sleep(min(60.0, 2.0 ** attempt))
                continue
            retry = resp.status_code >= 500 or _is_rate_limited(resp)
            if retry and attempt < RETRIES:
                self._sleep(_wait_seconds(resp, attempt))
                continue
            if resp.status_code in _ADVICE and not retry:
                raise GitHubAuthError(f"GitHub {method} {resp.url.path}: {resp.status_code}: "
                                      f"{_ADVICE[resp.status_code]}")
            if resp.is_error:
                raise InfrastructureError(f"GitHub {method} {resp.url.path}: HTTP "
                                          f"{resp.status_code} after {attempt + 1} attempt(s)")
            return resp
        raise AssertionError("unreachable")

    def list_comments(self, repo: str, pr: int) -> Iterator[Comment]:
        """Every comment of the PR's conversation, following Link pagination."""
        url: str | None = f"/repos/{repo}/issues/{pr}/comments?per_page=100"
        while url:
            resp = self._request("GET", url)
            for item in resp.json():
                yield Comment(id=int(item["id"]), author=str(item["user"]["login"]),
                              body=str(item.get("body") or ""))
            match = re.search(r'<([^>]+)>;\s*rel="next"', resp.headers.get("link", ""))
            url = match.group(1) if match else None

    def create_comment(self, repo: str, pr: int, body: str) -> int:
        """Post a new comment; returns its id."""
        resp = self._request("POST", f"/repos/{repo}/issues/{pr}/comments", json={"body": body})
        return int(resp.json()["id"])

    def update_comment(self, repo: str, comment_id: int, body: str) -> None:
        """Replace a comment's body."""
        self._request("PATCH", f"/repos/{repo}/issues/comments/{comment_id}", json={"body": body})
