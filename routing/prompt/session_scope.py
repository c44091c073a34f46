"""Session scope of a request, from its headers, and the keyed hash that stands in for it.

Scopes partition the image and embedding caches when session scoping is on. They are secrets
(a caller who learns one can read what was cached under it), so only `scope_hash` ever leaves
this module: it is what gets stored, logged, put into cache keys or shown in the admin.

How a Claude Code child agent is scoped: Claude Code sends `x-claude-code-session-id` on every
request of a session and adds `x-claude-code-agent-id` on the requests of a subagent it spawned.
A child agent gets a scope of its own, nested under its session: `<session>#agent=<agent>`. So a
subagent never shares cache entries with its parent or its siblings (the origin may serve it
other content), and two sessions that happen to reuse an agent id never share one either. An
agent id without a session id scopes on the agent id alone (`#agent=<agent>`). The `#`
separator is outside the accepted character set, so no single header value can forge a
combined scope.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Mapping

DYNAMO_SESSION_HEADER = "x-dynamo-session-id"
CLAUDE_CODE_SESSION_HEADER = "x-claude-code-session-id"
CLAUDE_CODE_AGENT_HEADER = "x-claude-code-agent-id"
CODEX_THREAD_HEADER = "thread-id"
OPENCODE_SESSION_HEADER = "x-session-id"

# Precedence order: the first header present with a non-blank value wins. The Claude Code
# agent header is not in this list: it only refines the Claude Code session (see the module
# docstring), or stands for it when the session header is missing.
SESSION_HEADERS: tuple[str, ...] = (
    DYNAMO_SESSION_HEADER,
    CLAUDE_CODE_SESSION_HEADER,
    CODEX_THREAD_HEADER,
    OPENCODE_SESSION_HEADER,
)

MAX_SCOPE_LENGTH = 256
SCOPE_HASH_LENGTH = 32

# UUIDs, ULIDs, `ses_...`, `thread_...`, base64url and dotted ids all fit; whitespace,
# control characters, quotes and `#` (the child-agent separator) do not.
_SAFE_SCOPE = re.compile(r"[A-Za-z0-9._:@+=/~-]+")


class SessionScopeError(ValueError):
    """A session header carries a value that cannot be a scope; the API answers 400."""

    def __init__(self, header: str, reason: str) -> None:
        super().__init__(f"invalid {header} header: {reason}")
        self.header = header


def _normalised(header: str, raw: str) -> str | None:
    value = raw.strip()
    if not value:
        return None
    if len(value) > MAX_SCOPE_LENGTH:
        raise SessionScopeError(header, f"longer than {MAX_SCOPE_LENGTH} characters")
    if not _SAFE_SCOPE.fullmatch(value):
        # The value itself is a secret and may be garbage: never echo it back.
        raise SessionScopeError(header, "only letters, digits and . _ : @ + = / ~ - are allowed")
    return value


def resolve_session_scope(headers: Mapping[str, str]) -> str | None:
    """The session scope a request's headers name, or None when none is given.

    Header names match case-insensitively. A blank header counts as absent, so the next one in
    precedence order is used. A present but malformed value raises `SessionScopeError` rather
    than falling through, so a typo never silently moves a session into another's scope.
    """
    lowered = {name.lower(): value for name, value in headers.items()}
    for header in SESSION_HEADERS:
        if header == CLAUDE_CODE_SESSION_HEADER:
            scope = _claude_code_scope(lowered)
        else:
            raw = lowered.get(header)
            scope = None if raw is None else _normalised(header, raw)
        if scope is not None:
            return scope
    return None


def _claude_code_scope(lowered: Mapping[str, str]) -> str | None:
    raw_session = lowered.get(CLAUDE_CODE_SESSION_HEADER)
    raw_agent = lowered.get(CLAUDE_CODE_AGENT_HEADER)
    session = None if raw_session is None else _normalised(CLAUDE_CODE_SESSION_HEADER, raw_session)
    agent = None if raw_agent is None else _normalised(CLAUDE_CODE_AGENT_HEADER, raw_agent)
    if agent is None:
        return session
    return f"{session or ''}#agent={agent}"


def scope_hash(scope: str, key: bytes, *, bind_to: str | None = None) -> str:
    """The keyed hash (HMAC-SHA256, 32 hex characters) that represents a scope everywhere.

    `bind_to` folds another identity (such as the authenticated API key's id) into the hash,
    so the same scope header sent by two callers names two partitions.
    """
    if not key:
        raise ValueError("scope_hash needs a non-empty secret key")
    if bind_to is None:
        message = b"s\x00" + scope.encode()
    else:
        # Length-prefixed so ("ab", "c") and ("a", "bc") cannot produce the same message.
        bound = bind_to.encode()
        message = b"b\x00" + len(bound).to_bytes(4, "big") + bound + scope.encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:SCOPE_HASH_LENGTH]
