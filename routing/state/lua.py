"""Lua run inside Redis: the `.lua` files, read and composed, and the scripts run by SHA.

Each script lives in a `lua/` folder beside the module that owns the keys it touches (the index's
in `routing/kv/lua/`, the media store's in `routing/media/lua/` ...). A script that calls shared
functions is composed here as Redis needs it: Redis runs one chunk per script and keeps no
functions between scripts, so the libraries' text goes in front of the script's, and their
`local function`s are in scope for it; the key names a module owns go in front the same way, as
Lua locals (`lua_constants`). Of the libraries' functions, only those the script calls (directly
or through another it keeps) go in: Redis runs the whole chunk at every call, and each `local
function` it runs makes a closure. Nothing else is done to the text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable, Sequence
from importlib import resources
from typing import Any

import redis

from routing.state.redis_direct import AsyncDirectCommands, Command, direct_commands, raise_first_error
from routing.state.redis_keys import reply_text


@functools.cache
def lua_text(package: str, name: str) -> str:
    """The text of `lua/<name>` beside the modules of `package` (a dotted name: "routing.kv").

    Read through importlib.resources, so the file is found the same way from a source checkout
    (the project is run from one, not installed) and from an installed copy.
    """
    return resources.files(package).joinpath("lua", name).read_text(encoding="utf-8")


def lua_constants(**names: str) -> str:
    """`local NAME = 'value'` for each, to compose in front of the Lua that uses them: the key
    families a module owns are named once, in its Python, and given to its scripts this way."""
    lines = []
    for name, value in names.items():
        if not value.isprintable() or "'" in value or "\\" in value:
            raise ValueError(f"{name} = {value!r} is not a plain Lua string literal")
        lines.append(f"local {name} = '{value}'\n")
    return "".join(lines)


def lua_script(package: str, name: str, *libraries: str) -> str:
    """The script `lua/<name>` of `package`, after the libraries it calls, in the order given,
    less the library functions it never calls (`used_functions_only`)."""
    script = lua_text(package, name)
    return used_functions_only("".join(libraries), script) + script


# A library function: `local function name(` at the start of a line, to the first line that is
# `end` alone (the libraries indent everything inside a function; tests/test_lua_scripts.py holds
# them to it).
_LIBRARY_FUNCTION = re.compile(r"^local function (\w+)\(.*?^end\n", re.MULTILINE | re.DOTALL)


def used_functions_only(libraries: str, script: str) -> str:
    """`libraries` without the `local function`s that neither `script` nor the libraries' own
    top-level lines (their constants, the overlap variant's choice) name, nor any function kept
    names. Redis runs a script's whole chunk at every call and each `local function` makes a
    closure there. Measured here against an empty script: the 36 functions the router's decision
    was composed with cost 13 us of every call (it keeps 20); the index's 20 cost 8.6 us of each
    `record_routed`, which calls 2 (1.3 us kept). A name counts wherever it appears (a comment
    too): what is kept is a superset of what is called, in the libraries' order, so each function
    still sees those it calls defined above it."""
    functions = {match.group(1): match for match in _LIBRARY_FUNCTION.finditer(libraries)}
    if not functions:
        return libraries
    named = re.compile(r"\b(" + "|".join(map(re.escape, functions)) + r")\b")
    outside = _LIBRARY_FUNCTION.sub("", libraries) + script
    kept: set[str] = set()
    todo = set(named.findall(outside))
    while todo:
        name = todo.pop()
        if name not in kept:
            kept.add(name)
            match = functions[name]
            todo.update(named.findall(libraries, match.end(1), match.end()))
    return _LIBRARY_FUNCTION.sub(lambda match: match.group(0) if match.group(1) in kept else "", libraries)


class LuaScript:
    """A script run by SHA, loaded on first use and again if Redis forgot it (restart, flush).

    redis-py's own Script checks SCRIPT EXISTS before every pipeline, an extra round trip the
    router's one-round-trip decision cannot afford; here a pipeline just sends EVALSHA. A call
    goes on the client's direct line (routing.state.redis_direct): the scripts are the router's hot
    path, and redis-py's per-command overhead is as long as the round trip.
    """

    def __init__(self, client: redis.Redis, source: str) -> None:
        self._direct = direct_commands(client)
        self.source = source
        self.sha = self._load()  # on the direct line: its connection is open before the first call

    def _load(self) -> str:
        sha = self._direct.execute("SCRIPT", "LOAD", self.source)
        return reply_text(sha)

    def __call__(self, *args: Any) -> Any:
        try:
            return self._direct.execute("EVALSHA", self.sha, 0, *args)
        except redis.exceptions.NoScriptError:
            self.sha = self._load()
            return self._direct.execute("EVALSHA", self.sha, 0, *args)

    async def acall(self, lines: AsyncDirectCommands, *args: Any, along: Sequence[Command] = ()) -> Any:
        """The script on an event loop's own connections (`lines`); its reply.

        `along`: commands of the caller's sent after it in the same round trip (a pipeline, not a
        transaction), each run once; the first of them to fail raises, after the script ran."""
        if not along:
            return await aevalsha(lines, self.sha, self.source, 0, *args)
        return (await self.acall_along(lines, *args, along=along))[0]

    async def acall_along(
        self, lines: AsyncDirectCommands, *args: Any, along: Sequence[Command]
    ) -> tuple[Any, list[Any]]:
        """`acall` that hands back the replies of `along` too (the script's, then theirs), for a
        caller that reads them: a stream read sent behind the script, say. A script Redis forgot
        runs again alone once they have run (once)."""
        script, *others = await lines.replies(("EVALSHA", self.sha, 0, *args), *along)
        if isinstance(script, redis.exceptions.NoScriptError):
            script = await aevalsha(lines, self.sha, self.source, 0, *args)
        elif isinstance(script, redis.ResponseError):
            raise script
        raise_first_error(others)
        return script, others

    def queue(self, pipe: redis.client.Pipeline, *args: Any) -> None:
        pipe.evalsha(self.sha, 0, *args)

    def reload(self) -> None:
        self.sha = self._load()


async def aevalsha(
    lines: AsyncDirectCommands, sha: str, source: str, numkeys: int, *keys_and_args: Any
) -> Any:
    """EVALSHA of `source` (whose SHA1 is `sha`) on an event loop's own connections (`lines`),
    loading it again first if Redis forgot it (restart, flush)."""
    try:
        return await lines.execute("EVALSHA", sha, numkeys, *keys_and_args)
    except redis.exceptions.NoScriptError:
        await lines.execute("SCRIPT", "LOAD", source)
        return await lines.execute("EVALSHA", sha, numkeys, *keys_and_args)


def execute_pipeline(pipe: redis.client.Pipeline, scripts: Iterable[LuaScript]) -> list[Any]:
    """Run a pipeline of EVALSHAs; if Redis lost the scripts, load them and run it once more.

    Only for pipelines whose commands can safely run twice (reads, idempotent sweeps).
    """
    commands = list(pipe.command_stack)
    try:
        return pipe.execute()
    except redis.exceptions.NoScriptError:
        reloaded = {}
        for script in scripts:
            old = script.sha
            script.reload()
            reloaded[old] = script.sha
        pipe.reset()
        for args, options in commands:
            if args[0] == "EVALSHA" and args[1] in reloaded:
                args = (args[0], reloaded[args[1]], *args[2:])
            pipe.execute_command(*args, **options)
        return pipe.execute()
