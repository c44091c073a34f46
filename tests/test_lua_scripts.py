"""The Lua run inside Redis: every `.lua` file is found from the source checkout, every script the
code composes from them compiles in the real Redis, and no Python string holds Lua any more."""

from __future__ import annotations

import ast
import hashlib
import re
from pathlib import Path

import pytest
import redis

from routing.admission.queue import AdmissionQueue
from routing.fleet import registry
from routing.kv.events import KvEventPublisher
from routing.kv.index import KvIndex
from routing.kv.load import LoadTracker
from routing.kv.router import KvRouter
from routing.media.store import MediaStore
from routing.state.lua import _LIBRARY_FUNCTION, LuaScript, lua_constants, lua_text
from tenants.limits import TenantLimiter

ROOT = Path(__file__).resolve().parent.parent
LUA_FILES = sorted(ROOT.glob("*/**/lua/*.lua"))
PYTHON_PACKAGES = ("routing", "tenants", "inference_platform", "workers")


def _sources(owner: object) -> dict[str, str]:
    """The scripts an object holds, by attribute: ours (LuaScript) and redis-py's (Script)."""
    found = {}
    for name, value in vars(owner).items():
        if isinstance(value, LuaScript):
            found[name] = value.source
        elif isinstance(value, redis.commands.core.Script):
            found[name] = value.script if isinstance(value.script, str) else value.script.decode()
    return found


@pytest.fixture
def composed_scripts(redis_client: redis.Redis, key_namespace: str) -> dict[str, str]:
    """Every script as the code composes it, with both of the index's overlap variants."""
    scripts: dict[str, str] = {"registry.remove": registry._REMOVE_OWN_LUA}
    for prefix_closed in (True, False):
        index = KvIndex(redis_client, key_namespace, prefix_closed=prefix_closed)
        load = LoadTracker(redis_client, key_namespace)
        owners = {
            "index": index,
            "load": load,
            "router": KvRouter(redis_client, key_namespace, index=index, load=load),
            "publisher": KvEventPublisher(redis_client, key_namespace, index=index),
        }
        for owner_name, owner in owners.items():
            for name, source in _sources(owner).items():
                scripts[f"{owner_name}.{name} ({index.overlaps_function})"] = source
    for owner_name, owner in {
        "media": MediaStore(redis_client, key_namespace),
        "limits": TenantLimiter(redis_client, key_namespace),
        "admission": AdmissionQueue(redis_client, key_namespace, "frontend", frontend_ttl_s=5.0),
    }.items():
        for name, source in _sources(owner).items():
            scripts[f"{owner_name}.{name}"] = source
    return scripts


def test_every_lua_file_is_read_from_the_source_checkout() -> None:
    # given the files beside the modules that own them
    assert len(LUA_FILES) >= 20
    for path in LUA_FILES:
        package = ".".join(path.parent.parent.relative_to(ROOT).parts)
        # when one is read as the code reads it, then it is the file's text
        assert lua_text(package, path.name) == path.read_text(encoding="utf-8"), path


def test_every_composed_script_compiles_in_redis(redis_client: redis.Redis, composed_scripts) -> None:
    for name, source in composed_scripts.items():
        # when Redis compiles it (SCRIPT LOAD runs nothing), then it answers the script's SHA
        sha = redis_client.script_load(source)
        assert sha == hashlib.sha1(source.encode()).hexdigest(), name


def _library_functions(text: str) -> dict[str, str]:
    return {match.group(1): match.group(0) for match in _LIBRARY_FUNCTION.finditer(text)}


def test_every_lua_file_is_part_of_a_script_the_code_runs(composed_scripts) -> None:
    everything = "\n".join(composed_scripts.values())
    unused = []
    for path in LUA_FILES:
        text = path.read_text()
        # a library's functions go only into the scripts that call them: each into one at least,
        # and every other line of the file too
        parts = [*_library_functions(text).values(), *_LIBRARY_FUNCTION.sub("", text).splitlines()]
        unused += [
            f"{path.relative_to(ROOT)}: {part.splitlines()[0]}" for part in parts if part not in everything
        ]
    assert unused == []


def test_a_composed_script_defines_every_library_function_it_calls(composed_scripts) -> None:
    library = {}
    for path in LUA_FILES:
        if path.name.endswith("_functions.lua"):
            library.update(_library_functions(path.read_text()))
    for name, source in composed_scripts.items():
        for function, text in library.items():
            # given a library function that the script calls (outside its own definition) ...
            if re.search(rf"\b{function}\(", source.replace(text, "")):
                # then it is defined in the script (in Redis, a name never defined is an error
                # only when the call runs)
                assert re.search(rf"^ *local function {function}\(", source, re.MULTILINE), (name, function)
    # and one that nothing in a script names is left out: the decision carries the overlap and
    # load functions, not the event log's
    decision = next(
        source for name, source in composed_scripts.items() if name.startswith("router._decision")
    )
    assert "local function kv_predict(" in decision and "local function kv_apply(" not in decision


def test_no_python_string_holds_lua() -> None:
    holding = []
    for package in PYTHON_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                text = node.value if isinstance(node, ast.Constant) else None
                if isinstance(text, str) and "redis.call" in text:
                    holding.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert holding == []


def test_key_names_reach_the_lua_as_plain_string_locals() -> None:
    assert lua_constants(TOTALS_KEY="load:totals") == "local TOTALS_KEY = 'load:totals'\n"
    for unsafe in ("it's", "a\\b", "two\nlines"):
        with pytest.raises(ValueError, match="plain Lua string"):
            lua_constants(NAME=unsafe)
