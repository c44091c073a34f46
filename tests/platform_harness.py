"""Starts the real platform for integration tests: `run_worker` processes and a uvicorn server.

Every process shares a SQLite file in the test's temporary directory and a Redis key namespace
of the test's own (Celery's broker keys included, through the same prefix), on the test Redis
database, so the test removes exactly what it wrote.
"""

from __future__ import annotations

import atexit
import copy
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent

# Each worker process a test starts is a line in this file (tests/conftest.py names it for the
# whole session, parallel test processes included), so the run's summary can say how many it
# started: starting one costs seconds, and the count is what keeps the suite fast. Each frontend
# (uvicorn) is a line too: one costs about 2 s of CPU, and the suite starts dozens.
WORKER_STARTS_FILE = "TEST_WORKER_STARTS_FILE"
WORKER_KINDS = ("model", "sim")

# Set by tests/conftest.py before each test's fixtures: only a test marked `integration` (which
# the fixtures that lead here mark) may start the platform's processes, so none can forget it.
# Outside pytest (the benches under bench/ drive this harness too) nothing is guarded.
guard_starts = False
starts_allowed_for: str | None = None


def _count_start(name: str, kind: str) -> None:
    path = os.environ.get(WORKER_STARTS_FILE)
    if path:
        # The test module that started it, for the summary's account (`-` outside a test).
        module = (starts_allowed_for or "-").split("::")[0].replace(" ", "_")
        with open(path, "a", encoding="utf-8") as starts:
            starts.write(f"{name} {module} {kind}\n")


def count_worker_start(name: str, *, simulated: bool = False) -> None:
    """Record one started `run_worker` process (see WORKER_STARTS_FILE)."""
    _count_start(name, "sim" if simulated else "model")


def _started() -> list[list[str]]:
    """Each start this session recorded, as its fields: name, test module, kind (`_count_start`)."""
    path = os.environ.get(WORKER_STARTS_FILE)
    if not path or not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as starts:
        return [line.split() for line in starts]


def _starts(kinds: tuple[str, ...]) -> int:
    return sum(1 for fields in _started() if fields[-1] in kinds)


def worker_starts_by_module() -> dict[str, int]:
    """This session's `run_worker` starts, by the test module that made them, most first."""
    counts: dict[str, int] = {}
    for fields in _started():
        if fields[-1] in WORKER_KINDS:
            counts[fields[-2]] = counts.get(fields[-2], 0) + 1
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def worker_starts(kind: str | None = None) -> int:
    """How many `run_worker` processes this session has started so far: of `kind` ("model" or
    "sim") or of either."""
    return _starts(WORKER_KINDS if kind is None else (kind,))


def frontend_starts() -> int:
    """How many frontend (uvicorn) processes this session has started so far."""
    return _starts(("frontend",))


def _require_integration_marker(what: str) -> None:
    if guard_starts and starts_allowed_for is None:
        raise RuntimeError(
            f"a test started {what} without the `integration` marker: reach the platform through "
            "tests/conftest.py's fixtures (platform_harness, platform_processes, worker_pool), which mark it"
        )


# A worker with no model (workers.sim_engine: the native scheduler and prefix pool, counted
# tokens): it starts in about a second instead of loading torch and the model. For the tests of
# what the platform does around a worker (kills, restarts, freezes, routing), not of its answers.
SIMULATED = ("--engine", "sim")


def run_worker_args(name: str, *extra: str) -> list[str]:
    """The command line of a `run_worker` process, counted as started (its caller starts it)."""
    _require_integration_marker(f"worker {name}")
    count_worker_start(name, simulated=_engine_of(extra) == "sim")
    return [sys.executable, "manage.py", "run_worker", "--name", name, *extra]


def _engine_of(args: tuple[str, ...]) -> str:
    return args[args.index("--engine") + 1] if "--engine" in args[:-1] else "native"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PrivateRedis:
    """A redis-server of the test's own on a free port, which the test may kill, restart or freeze."""

    def __init__(self, directory: str | Path) -> None:
        self.port = free_port()
        self.directory = directory
        self.process: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--save", "", "--appendonly", "no"],
            cwd=self.directory,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.kill()


_MIGRATE_AND_CREATE_KEY = """
import django
django.setup()
from django.core.management import call_command
call_command("migrate", interactive=False, verbosity=0)
call_command("api_keys", "create", "--tenant", "harness", "--create-tenant", "--name", "harness", "--staff")
"""


_MAKE_KEYS = """
import json, sys
import django
django.setup()
from tenants.keys import create_api_key
from tenants.models import Tenant
keys = []
for spec in json.loads(sys.argv[1]):
    spec = dict(spec)
    name, staff = spec.pop("tenant"), spec.pop("staff", False)
    tenant, _ = Tenant.objects.update_or_create(name=name, defaults=spec)
    keys.append(create_api_key(tenant, "test", staff=staff)[1])
print(json.dumps(keys))
"""


class _Template(NamedTuple):
    path: Path
    api_key: str


_template: _Template | None = None


def _remember_template(database: Path, api_key: str) -> None:
    """Keep a copy of a freshly migrated database (the test's may change it) for later platforms."""
    global _template
    directory = Path(tempfile.mkdtemp(prefix="platform-template-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    copy = directory / "db.sqlite3"
    shutil.copyfile(database, copy)
    _template = _Template(copy, api_key)


class PlatformProcesses:
    def __init__(
        self,
        tmp: Path,
        model_dir: Path,
        redis_url: str,
        namespace: str,
        env: Mapping[str, str] | None = None,
        *,
        api_key: str | None = None,
    ) -> None:
        self.tmp = tmp
        self.namespace = namespace
        self.redis = redis.Redis.from_url(redis_url)
        self.env = {
            **os.environ,
            "DJANGO_SETTINGS_MODULE": "inference_platform.settings",
            "DATABASE_URL": f"sqlite:///{tmp / 'db.sqlite3'}",
            "REDIS_URL": redis_url,
            "REDIS_KEY_PREFIX": namespace,
            "MODEL_PATH": str(model_dir),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "WORKER_HEARTBEAT_TTL_SECS": "2",
            "WORKER_HEARTBEAT_INTERVAL_SECS": "0.4",
            "WORKER_TORCH_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            # Nothing may be downloaded at run time: any attempt to leave the machine goes to a
            # closed port and fails, so every test that passes here proves it needed nothing.
            "HTTP_PROXY": "http://127.0.0.1:9",
            "HTTPS_PROXY": "http://127.0.0.1:9",
            "NO_PROXY": "127.0.0.1,localhost",
            **(env or {}),
        }
        self.env.pop("PYTEST_CURRENT_TEST", None)
        self.workers: dict[str, subprocess.Popen] = {}
        self._fleet_of: dict[str, str] = {}  # a simulated worker's name -> its process's (start_sim_workers)
        self.servers: list[subprocess.Popen] = []
        self.server_urls: list[str] = []  # each server's base URL, in the order of `servers`
        self.base_url = ""  # the first server's
        self._pool: PlatformProcesses | None = None  # the platform whose workers this one borrows
        self.api_key = self._fresh_database(env or {}) if api_key is None else api_key
        self.headers = {"Authorization": f"Bearer {self.api_key}"}

    @classmethod
    def joining(
        cls, pool: PlatformProcesses, tmp: Path, api_key: str, env: Mapping[str, str] | None = None
    ) -> PlatformProcesses:
        """Frontends of a test's own, with settings of its own (`env`: frontend settings only), in
        front of a running platform's workers: same Redis namespace, same database (the workers
        write their rows there), a tenant of the test's own (`api_key`). Closing it stops only
        what it started; the pool's workers and keys stay for the next test."""
        joined = cls(
            tmp,
            Path(pool.env["MODEL_PATH"]),
            pool.env["REDIS_URL"],
            pool.namespace,
            {**{k: v for k, v in pool.env.items() if os.environ.get(k) != v}, **(env or {})},
            api_key=api_key,
        )
        joined.env["DATABASE_URL"] = pool.env["DATABASE_URL"]
        # the pool's to read (pids, logs); a test that stops one of them is not a pool test, but
        # it may start and stop workers of its own beside them
        joined.workers = dict(pool.workers)
        joined._fleet_of = dict(pool._fleet_of)
        joined._pool = pool
        return joined

    def as_tenant(self, api_key: str) -> PlatformProcesses:
        """This platform's running processes as another tenant (`api_key`) sees them: how a test
        uses a frontend that the session shares. The view starts and stops nothing; its owner
        closes the platform."""
        view = copy.copy(self)
        view.api_key = api_key
        view.headers = {"Authorization": f"Bearer {api_key}"}
        return view

    def _fresh_database(self, env: Mapping[str, str]) -> str:
        """A migrated database holding the test's API key; the key's plaintext.

        Migrations and the key in one process (authentication stays on): an operator key of the
        tenant "harness", isolated from any other tenant a test creates. The first platform of
        a test session makes that database; every later one starts from a copy of it (the same
        migrations and key, a file of its own), which saves a Django process per platform.
        """
        database = self.tmp / "db.sqlite3"
        own_database = "DATABASE_URL" in env
        if _template is not None and not own_database:
            shutil.copyfile(_template.path, database)
            return _template.api_key
        created = subprocess.run(
            [sys.executable, "-c", _MIGRATE_AND_CREATE_KEY],
            cwd=REPO,
            env=self.env,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        api_key = created.stdout.strip().splitlines()[-1]
        if not own_database:
            _remember_template(database, api_key)
        return api_key

    @property
    def database(self) -> Path:
        """The SQLite file every process of the platform uses (a joined platform's is its pool's)."""
        return Path(self.env["DATABASE_URL"].removeprefix("sqlite:///"))

    @property
    def statistics_namespace(self) -> str:
        """Where this platform's counters are (routing.deployment): its prefix and its database's
        deployment id, which its first process to count anything made."""
        import sqlite3

        with sqlite3.connect(self.database) as db:
            row = db.execute("SELECT deployment_id FROM routing_deployment").fetchone()
        assert row is not None, "no process of this platform has counted anything yet"
        return f"{self.namespace}dep:{row[0]}:"

    def make_keys(self, *specs: dict) -> list[str]:
        """API keys for tenants of the test's own, in one process; each spec names a `tenant` and
        may set `staff` and the tenant's fields (limits, share_prefix_cache). Plaintexts, in order."""
        created = subprocess.run(
            [sys.executable, "-c", _MAKE_KEYS, json.dumps(list(specs))],
            cwd=REPO,
            env=self.env,
            check=True,
            timeout=120,
            capture_output=True,
            text=True,
        )
        return json.loads(created.stdout.strip().splitlines()[-1])

    def manage(self, *args: str, env: Mapping[str, str] | None = None) -> str:
        """`manage.py` as an operator runs it against this platform (with the platform's settings,
        or `env`); its standard output. A failure shows the command's standard error."""
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=REPO,
            env=self.env if env is None else env,
            timeout=120,
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, f"manage.py {' '.join(args)} failed:\n{done.stderr}"
        return done.stdout

    def make_superuser(self, username: str, password: str) -> None:
        """An admin login in the platform's database, made as an operator makes one."""
        self.manage(
            "createsuperuser", "--noinput", "--username", username, "--email", "",
            env={**self.env, "DJANGO_SUPERUSER_PASSWORD": password},
        )  # fmt: skip

    def staff_session(self, username: str, password: str, base_url: str = "") -> httpx.Client:
        """An HTTP client logged into a frontend's admin (the first frontend's unless `base_url`
        says), as a browser is."""
        client = httpx.Client(base_url=base_url or self.base_url, timeout=30)
        page = client.get("/admin/login/")
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page.text)
        assert token, "the login page has a CSRF token"
        answer = client.post(
            "/admin/login/?next=/admin/",
            data={"username": username, "password": password, "csrfmiddlewaretoken": token[1]},
        )
        assert answer.status_code == 302, answer.text[:500]
        return client

    def _spawn(self, label: str, args: list[str], env: Mapping[str, str] | None = None) -> subprocess.Popen:
        log = self.tmp / f"{label}.log"
        if log.exists():  # a process started again under its label: its predecessor's log is kept
            earlier = sum(1 for _ in self.tmp.glob(f"{label}.log.*"))
            log.rename(log.with_name(f"{log.name}.{earlier + 1}"))
        handle = log.open("wb")
        return subprocess.Popen(
            args, cwd=REPO, env={**self.env, **(env or {})}, stdout=handle, stderr=subprocess.STDOUT
        )

    def heartbeat_key(self, name: str) -> str:
        return f"{self.namespace}hb:{name}"

    def start_worker(self, name: str, *extra: str, python: str | None = None) -> None:
        """`run_worker` under this test's interpreter, or `python` (the vLLM virtualenv's, say)."""
        args = run_worker_args(name, *extra)
        if python is not None:
            args[0] = python
        self.workers[name] = self._spawn(f"worker-{name}", args)

    def start_sim_workers(self, name: str, count: int, *extra: str) -> list[str]:
        """`count` simulated workers in one `run_worker --engine sim` process (workers.sim_engine);
        their names, to wait for with `wait_for_workers`."""
        args = run_worker_args(name, "--engine", "sim", "--count", str(count), *extra)
        self.workers[name] = self._spawn(f"worker-{name}", args)
        members = [name] if count == 1 else [f"{name}-{i}" for i in range(count)]
        self._fleet_of.update({member: name for member in members})
        return members

    @property
    def simulated_workers(self) -> list[str]:
        """The names of the simulated workers its `start_sim_workers` started (a pool's too)."""
        return list(self._fleet_of)

    def wait_for_workers(self, *names: str, timeout: float = 90.0) -> None:
        """Waits for each worker's heartbeat (a simulated one's is its own, its process shared)."""
        deadline = time.monotonic() + timeout
        for name in names:
            process_name = self._fleet_of.get(name, name)
            while not self.redis.exists(self.heartbeat_key(name)):
                process = self.workers[process_name]
                if process.poll() is not None:
                    raise AssertionError(
                        f"worker {name} exited early:\n{self.log_tail(f'worker-{process_name}')}"
                    )
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"worker {name} did not register:\n{self.log_tail(f'worker-{process_name}')}"
                    )
                time.sleep(0.1)
        # Registered means the model is loaded; then Celery starts consuming, which it logs at
        # INFO ("<name>@<host> ready."). Wait for that line, or a second where the log level
        # hides it (each spawn starts its log afresh, so a line is this process's own).
        processes = {self._fleet_of.get(name, name) for name in names}
        settled = time.monotonic() + 1.0
        while time.monotonic() < settled and not all(self._consuming(name) for name in processes):
            time.sleep(0.05)

    def wait_until_idle(self, name: str, timeout: float = 60.0) -> None:
        """Waits for a heartbeat of worker `name` that reports nothing running or waiting: what
        the routers read of it then counts no earlier request (a test that shares the worker
        freezes it only once it is idle)."""
        deadline = time.monotonic() + timeout
        while True:
            beat = self.redis.get(self.heartbeat_key(name))
            if beat is not None and json.loads(beat)["running"] == json.loads(beat)["waiting"] == 0:
                return
            assert time.monotonic() < deadline, f"worker {name} never reported itself idle: {beat!r}"
            time.sleep(0.05)

    def _consuming(self, name: str) -> bool:
        return re.search(rf"\b{re.escape(name)}@\S+ ready\.", self.log(f"worker-{name}")) is not None

    def start_server(self, timeout: float = 60.0, **env: str) -> str:
        """Start one more frontend process, `env` its settings on top of the platform's; returns its
        base URL (the first is also `base_url`)."""
        _require_integration_marker("a frontend")
        port = free_port()
        label = "server" if not self.servers else f"server-{len(self.servers)}"
        server = self._spawn(
            label,
            [
                sys.executable,
                "-m",
                "uvicorn",
                "inference_platform.asgi:application",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--no-access-log",
            ],
            env,
        )
        _count_start(label, "frontend")
        self.servers.append(server)
        base_url = f"http://127.0.0.1:{port}"
        self.server_urls.append(base_url)
        self.base_url = self.base_url or base_url
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server.poll() is not None:
                raise AssertionError(f"server exited early:\n{self.log_tail(label)}")
            try:
                if httpx.get(f"{base_url}/v1/models", headers=self.headers, timeout=2).status_code == 200:
                    return base_url
            except httpx.HTTPError:
                time.sleep(0.2)
        raise AssertionError(f"server did not answer:\n{self.log_tail(label)}")

    def stop_worker(self, name: str, sig: int = signal.SIGTERM, wait: bool = True) -> int | None:
        process = self.workers[name]
        process.send_signal(sig)
        return process.wait(timeout=60) if wait else None

    def _log_path(self, label: str) -> Path:
        member = label.removeprefix("worker-")
        if member != label and member in self._fleet_of:  # a simulated worker: its process's log
            label = f"worker-{self._fleet_of[member]}"
        own = self.tmp / f"{label}.log"
        if own.exists() or self._pool is None:
            return own
        return self._pool._log_path(label)  # a pooled worker's

    def log(self, label: str) -> str:
        path = self._log_path(label)
        return path.read_text(errors="replace") if path.exists() else ""

    def log_tail(self, label: str, lines: int = 40) -> str:
        path = self._log_path(label)
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def close(self) -> None:
        if self._pool is not None:  # the namespace and the pool's workers stay for the next test
            own = [process for name, process in self.workers.items() if name not in self._pool.workers]
            self._stop([*own, *self.servers])
            self.redis.close()
            return
        self._stop([*self.workers.values(), *self.servers])
        for key in self.redis.scan_iter(match=f"{self.namespace}*", count=1000):
            self.redis.delete(key)
        self.redis.close()

    @staticmethod
    def _stop(processes: list[subprocess.Popen]) -> None:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
