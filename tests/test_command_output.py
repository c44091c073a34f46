"""Management commands as a shell runs them: reading standard input, writing into a closed pipe."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMMANDS = ["routing_stats", "flush_caches"]
CHAT = {"messages": [{"role": "user", "content": "Where do rivers begin?"}]}


@pytest.fixture(scope="module")
def command_env(demo_model_dir, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment of a shell with a migrated database; migrated once (a Django process of its
    own), since the commands here only read it."""
    database = tmp_path_factory.mktemp("commands") / "db.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
        "DATABASE_URL": f"sqlite:///{database}",
        "MODEL_PATH": str(demo_model_dir),
        "PYTHONUNBUFFERED": "0",
    }
    subprocess.run([sys.executable, "manage.py", "migrate", "-v", "0"], cwd=REPO, env=env, check=True)
    return env


def run_into_closed_pipe(args: list[str], env: dict[str, str], stdin: bytes = b"") -> subprocess.Popen:
    """Starts `manage.py args` with its standard output a pipe nobody reads (`| head` gone)."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    process = subprocess.Popen(
        [sys.executable, "manage.py", *args],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=write_end,
        stderr=subprocess.PIPE,
    )
    os.close(write_end)
    process.stdin.write(stdin)
    process.stdin.close()
    return process


def test_inspect_request_reads_the_request_from_standard_input(command_env):
    done = subprocess.run(
        [sys.executable, "manage.py", "inspect_request", "-", "--json"],
        cwd=REPO,
        env=command_env,
        input=json.dumps(CHAT).encode(),
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()
    description = json.loads(done.stdout)
    assert description["prompt_tokens"] > 5 and description["images"] == []


def test_every_command_survives_a_closed_pipe_without_a_traceback(command_env):
    # given commands' help (argparse exits right after writing it), and a real command's output,
    # written into a pipe already closed. Every command runs through manage.py, where the closed
    # pipe is handled: a few of them stand for all.
    runs = {name: run_into_closed_pipe([name, "--help"], command_env) for name in COMMANDS}
    runs["inspect_request -"] = run_into_closed_pipe(
        ["inspect_request", "-"], command_env, stdin=json.dumps(CHAT).encode()
    )
    # then none of them prints a traceback or Python's "Exception ignored" complaint
    for name, process in runs.items():
        stderr = process.stderr.read().decode()
        process.wait(timeout=120)
        assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, f"{name}:\n{stderr}"
        assert process.returncode in (0, 141), f"{name} exited {process.returncode}:\n{stderr}"
