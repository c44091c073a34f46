"""The router's decision script in Redis, two versions side by side on the same decisions: a low-noise
A/B of a change to `routing/kv/lua/decision.lua`.

Why: `bench/fleet.py` times decisions as a frontend makes them, one after another with the
frontend's own work between them, and its Redis-side figure moves by a third from run to run on
a shared 2-core VM (177 to 282 us per decision in seven runs of one commit): Redis idles between
two decisions, and how cold its caches are then is up to the machine. A change worth 10 us cannot
be seen there. Here each decision is replayed back to back, the two scripts in a fresh random
order for every decision, so both meet the same machine; each script also runs a second time
under another SHA (the null pair), which shows what a ratio of 1.00 looks like in that run.

What runs: bench/fleet.py's fleet (its own redis-server, 1,024 simulated workers registered as
run_worker registers them, their caches in the index), FLEET_DECISIONS (400 here) decisions made
through the frontend's path while the workers beat, and its 200 more, each decision script call's
arguments kept as sent. Then ROUNDS passes over those arguments: each call made again with a
request id of its own (so each reserves, as a request does) and its lease freed after it; the
fleet's facts are put back as they were before each pass (they expire in a minute). Redis's
command log (SLOWLOG at threshold 0) gives each call's us, as bench/fleet.py reads them. `ROUNDS`
is `--rounds`.

The two versions: the working tree's script, and the baseline, the same composition with
decision.lua's text taken from a git ref (`--baseline-ref`, default HEAD) or a file
(`--baseline-lua`). The libraries composed in front of it (index, overlaps, load and sweep
functions) are the working tree's for both, and both get the working tree's arguments: the
baseline must read the same ARGV layout (a new trailing argument is ignored by an older script).

Usage: .venv/bin/python bench/decision_script.py [--baseline-ref REF | --baseline-lua FILE]
[--rounds N]. About two minutes, most of it filling the fleet. The last line:
    script_us=… baseline_us=… ratio=… null_ratio=…
(medians of each call's us; the ratio is the working tree's over the baseline's; the null ratio
the working tree's second SHA over its first).
"""

from __future__ import annotations

import argparse
import os
import random
import runpy
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("FLEET_DECISIONS", "400")
os.environ.setdefault("FLEET_REPLICA", "1")
DECISION_LUA = REPO / "routing" / "kv" / "lua" / "decision.lua"
WORKERS = 1024


def baseline_text(args: argparse.Namespace) -> str:
    if args.baseline_lua:
        return Path(args.baseline_lua).read_text(encoding="utf-8")
    return subprocess.run(
        ["git", "-C", str(REPO), "show", f"{args.baseline_ref}:routing/kv/lua/decision.lua"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--baseline-ref", default="HEAD", help="git ref whose decision.lua is the baseline")
    which.add_argument("--baseline-lua", help="a decision.lua file to use as the baseline instead")
    parser.add_argument("--rounds", type=int, default=6, help="passes over the decisions (default 6)")
    args = parser.parse_args()

    # bench/fleet.py's module: its redis-server, settings and fleet-filling functions (not its main)
    fleet = runpy.run_path(str(REPO / "bench" / "fleet.py"), run_name="fleet_for_decision_script")
    from django.conf import settings
    from django.core.management import call_command

    from inference_platform.serving.frontend import frontend
    from routing.state.lua import LuaScript

    call_command("migrate", verbosity=0)
    client = fleet["sync_client"](settings.REDIS_URL)
    calls: list[tuple] = []
    facts: dict[object, bytes] = {}  # key -> DUMP of each fleet read's facts and places the calls named
    acall = LuaScript.acall

    async def kept_acall(self, lines, *call_args, along=()):
        if self is frontend().router()._decision:
            calls.append(call_args)
            for key in (call_args[29], call_args[34]):  # ARGV 30 and 35: the facts and their places
                if key and key not in facts:
                    facts[key] = client.dump(key)
        return await acall(self, lines, *call_args, along=along)

    LuaScript.acall = kept_acall
    settings.ROUTER_INDEX_REPLICA = os.environ["FLEET_REPLICA"] != "0"
    try:
        fleet["run_size"](WORKERS, several=False)
    finally:
        LuaScript.acall = acall
    try:
        router = frontend().router()
        script = router._decision.source
        ours = DECISION_LUA.read_text(encoding="utf-8").strip()
        if script.count(ours) != 1:
            raise SystemExit("decision.lua's text is not in the composed script as it is in the file")
        versions = {
            "script": script,
            "baseline": script.replace(ours, baseline_text(args).strip()),
            "script (again)": script + "\n",  # another SHA, the same script: the null pair
        }
        if versions["baseline"] == script:
            print("(the baseline's decision.lua is the working tree's: every ratio is a null one)")
            versions["baseline"] = script + "\n\n"  # a SHA of its own
        shas = {client.script_load(text): name for name, text in versions.items()}
        decisions = [call for call in calls if call[29]]  # among candidates, as at this fleet's size
        print(
            f"{len(decisions)} decisions among candidates at {WORKERS} workers, replayed "
            f"{args.rounds} times, {len(versions)} scripts each in a random order"
        )
        usec: dict[str, list[int]] = {name: [] for name in versions}
        draw = random.Random(20261207)
        saved = client.config_get("slowlog-*")
        client.config_set("slowlog-max-len", 1_000_000)
        client.config_set("slowlog-log-slower-than", 0)
        try:
            for round_ in range(args.rounds):
                for key, dumped in facts.items():
                    client.restore(key, 0, dumped, replace=True)
                client.slowlog_reset()
                for i, call in enumerate(decisions):
                    order = list(shas)
                    draw.shuffle(order)
                    for sha in order:
                        call_args = list(call)
                        call_args[3] = f"replay-{round_}-{i}-{sha[:8]}"  # ARGV 4: a request id of its own
                        call_args[27], call_args[28] = "", ""  # ARGV 28, 29: no generation to check
                        reply = client.evalsha(sha, 0, *call_args)
                        if reply[0]:
                            worker = reply[7][reply[0] - 1]
                            router.load.free(worker.decode(), call_args[3])
                for entry in client.execute_command("SLOWLOG", "GET", "-1"):
                    command = entry[3]
                    if command and command[0].upper() == b"EVALSHA" and command[1].decode() in shas:
                        usec[shas[command[1].decode()]].append(entry[2])
        finally:
            for name, value in saved.items():
                client.config_set(name, value)
            client.slowlog_reset()
        print(f"{'':16}{'median us':>10}{'p10 us':>8}{'p90 us':>8}{'mean us':>9}{'calls':>7}")
        for name, values in usec.items():
            ordered = sorted(values)
            print(
                f"{name:16}{statistics.median(values):>10.1f}{ordered[len(ordered) // 10]:>8}"
                f"{ordered[9 * len(ordered) // 10]:>8}{statistics.mean(values):>9.1f}{len(values):>7}"
            )
        ours_us, base_us = statistics.median(usec["script"]), statistics.median(usec["baseline"])
        null = statistics.median(usec["script (again)"]) / ours_us
        ratio = ours_us / base_us
        print(f"script_us={ours_us:.1f} baseline_us={base_us:.1f} ratio={ratio:.3f} null_ratio={null:.3f}")
    finally:
        frontend().reset()
        fleet["_REDIS"].stop()


if __name__ == "__main__":
    sys.exit(main())
