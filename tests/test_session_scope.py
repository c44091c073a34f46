"""Session scope resolution from request headers, and the keyed hash that stands in for it."""

from __future__ import annotations

import pytest

from routing.prompt.session_scope import (
    MAX_SCOPE_LENGTH,
    SESSION_HEADERS,
    SessionScopeError,
    resolve_session_scope,
    scope_hash,
)

KEY = b"deployment-secret"


def test_headers_are_tried_in_dynamo_precedence_order() -> None:
    assert SESSION_HEADERS == ("x-dynamo-session-id", "x-claude-code-session-id", "thread-id", "x-session-id")
    everything = {
        "x-session-id": "opencode",
        "thread-id": "codex",
        "x-claude-code-session-id": "claude",
        "x-dynamo-session-id": "dynamo",
    }
    assert resolve_session_scope(everything) == "dynamo"
    del everything["x-dynamo-session-id"]
    assert resolve_session_scope(everything) == "claude"
    del everything["x-claude-code-session-id"]
    assert resolve_session_scope(everything) == "codex"
    del everything["thread-id"]
    assert resolve_session_scope(everything) == "opencode"


def test_header_names_match_whatever_their_case() -> None:
    assert resolve_session_scope({"X-Dynamo-Session-Id": "abc", "X-SESSION-ID": "other"}) == "abc"


def test_values_are_trimmed() -> None:
    assert resolve_session_scope({"thread-id": "  0195f3c2-7f1e-7a0b  \t"}) == "0195f3c2-7f1e-7a0b"


def test_no_header_or_only_blank_headers_give_no_scope() -> None:
    assert resolve_session_scope({}) is None
    assert resolve_session_scope({"content-type": "application/json"}) is None
    assert resolve_session_scope({"x-dynamo-session-id": "   ", "x-session-id": ""}) is None


def test_a_blank_header_gives_way_to_the_next_one() -> None:
    assert resolve_session_scope({"x-dynamo-session-id": " ", "x-session-id": "ses_42"}) == "ses_42"


def test_a_child_agent_gets_its_own_scope_under_its_session() -> None:
    parent = resolve_session_scope({"x-claude-code-session-id": "s-1"})
    child = resolve_session_scope({"x-claude-code-session-id": "s-1", "x-claude-code-agent-id": "a-7"})
    sibling = resolve_session_scope({"x-claude-code-session-id": "s-1", "x-claude-code-agent-id": "a-8"})
    other_session = resolve_session_scope(
        {"x-claude-code-session-id": "s-2", "x-claude-code-agent-id": "a-7"}
    )
    assert parent == "s-1"
    assert child == "s-1#agent=a-7"
    assert len({parent, child, sibling, other_session}) == 4


def test_an_agent_id_alone_scopes_on_the_agent() -> None:
    assert resolve_session_scope({"x-claude-code-agent-id": "a-7"}) == "#agent=a-7"


def test_an_explicit_dynamo_session_wins_over_a_child_agent() -> None:
    headers = {"x-dynamo-session-id": "d", "x-claude-code-session-id": "s", "x-claude-code-agent-id": "a"}
    assert resolve_session_scope(headers) == "d"


def test_no_single_header_value_can_forge_a_child_agent_scope() -> None:
    with pytest.raises(SessionScopeError):
        resolve_session_scope({"x-dynamo-session-id": "s-1#agent=a-7"})


@pytest.mark.parametrize("bad", ["has space", "tab\there", 'quote"d', "semi;colon", "line\nbreak", "é"])
def test_a_malformed_scope_is_refused_naming_the_header(bad: str) -> None:
    with pytest.raises(SessionScopeError) as refused:
        resolve_session_scope({"Thread-Id": bad})
    assert refused.value.header == "thread-id"
    assert "thread-id" in str(refused.value)


def test_a_malformed_agent_id_is_refused_naming_its_header() -> None:
    with pytest.raises(SessionScopeError, match="x-claude-code-agent-id"):
        resolve_session_scope({"x-claude-code-session-id": "s", "x-claude-code-agent-id": "a b"})


def test_a_malformed_header_is_refused_even_when_a_later_one_is_fine() -> None:
    with pytest.raises(SessionScopeError, match="x-dynamo-session-id"):
        resolve_session_scope({"x-dynamo-session-id": "bad value", "x-session-id": "fine"})


def test_the_refusal_never_echoes_the_secret_value() -> None:
    with pytest.raises(SessionScopeError) as refused:
        resolve_session_scope({"x-session-id": "topsecret value"})
    assert "topsecret" not in str(refused.value)


def test_scope_length_is_bounded() -> None:
    longest = "a" * MAX_SCOPE_LENGTH
    assert resolve_session_scope({"x-session-id": longest}) == longest
    with pytest.raises(SessionScopeError, match="x-session-id"):
        resolve_session_scope({"x-session-id": longest + "a"})


def test_scope_hash_is_32_hex_characters_and_never_the_scope() -> None:
    digest = scope_hash("0123456789abcdef0123456789abcdef", KEY)
    assert len(digest) == 32
    int(digest, 16)
    assert digest != "0123456789abcdef0123456789abcdef"
    assert "0123456789abcdef" not in digest


def test_scope_hash_is_stable_for_one_key_and_differs_between_keys() -> None:
    assert scope_hash("s-1", KEY) == scope_hash("s-1", KEY)
    assert scope_hash("s-1", KEY) != scope_hash("s-1", b"another-deployment")
    assert scope_hash("s-1", KEY) != scope_hash("s-2", KEY)


def test_binding_to_an_api_key_gives_each_caller_its_own_partition() -> None:
    unbound = scope_hash("s-1", KEY)
    alice = scope_hash("s-1", KEY, bind_to="key-alice")
    bob = scope_hash("s-1", KEY, bind_to="key-bob")
    assert len({unbound, alice, bob}) == 3
    # The binding is length-prefixed: shifting characters between the parts changes the hash.
    assert scope_hash("bc", KEY, bind_to="a") != scope_hash("c", KEY, bind_to="ab")


def test_scope_hash_refuses_an_empty_key() -> None:
    with pytest.raises(ValueError):
        scope_hash("s-1", b"")
