"""The real things the tests run against: a `holdfast dev` cluster (five server processes, three groups),
the reference fenced store, and a PostgreSQL server, each started here and stopped at the end.

The Holdfast binary is $HOLDFAST_BIN, or target/debug/holdfast (then target/release/holdfast) of the
checkout. Every process is started in its own process group and only those groups are signalled.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

import pytest

import holdfast

REPO = Path(__file__).resolve().parents[3]
STARTUP = 90.0  # seconds a debug build of five servers may take to elect leaders on a loaded 2-core machine


def holdfast_bin() -> str:
    if os.environ.get("HOLDFAST_BIN"):
        return os.environ["HOLDFAST_BIN"]
    for build in ("debug", "release"):
        p = REPO / "target" / build / "holdfast"
        if p.exists():
            return str(p)
    raise RuntimeError("no holdfast binary: cargo build -p holdfast, or set HOLDFAST_BIN")


def free_base_port(span: int = 205) -> int:
    """A base port whose client (+0..4), peer (+100..104) and HTTP (+200..204) ports are all free now.

    Below the kernel's ephemeral range (32768 and up on Linux), as the Rust harness's ports are: a port
    in that range can be free when checked and then taken by an outgoing connection (the first servers'
    connections to their peers) before the last server binds it, which failed a CI run with "Address
    already in use" for node 5."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32768 - span)
        ports = [base + off + n for off in (0, 100, 200) for n in range(5)]
        try:
            for p in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise RuntimeError("no free port range")


class DevCluster:
    """`holdfast dev` with its own data dir and ports; `kill`/`restart` go through `holdfast dev kill`."""

    def __init__(self, groups: int = 3) -> None:
        self.dir = tempfile.mkdtemp(prefix="holdfast-py-")
        self.base = free_base_port()
        self.groups = groups
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.proc = subprocess.Popen(
            [holdfast_bin(), "dev", "--data-dir", self.dir, "--base-port", str(self.base),
             "--groups", str(groups)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(STARTUP) or self.proc.poll() is not None:
            output = "\n".join(self.lines)
            self.stop()
            raise RuntimeError(f"holdfast dev did not become ready within {STARTUP} s:\n{output}")
        self.endpoints = [f"127.0.0.1:{self.base + n}" for n in range(5)]

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            if "cluster ready" in line:
                self._ready.set()
        self._ready.set()  # exited: the waiter checks poll()

    def banner(self) -> str:
        return "\n".join(self.lines)

    def control(self, action: str, node: int) -> None:
        subprocess.run(
            [holdfast_bin(), "dev", action, str(node), "--data-dir", self.dir],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def leader_of(self, group: int) -> int:
        """The node id leading ``group``, as a live server reports it (waits for one, up to 30 s)."""
        end = time.monotonic() + 30
        while time.monotonic() < end:
            for ep in self.endpoints:
                try:
                    with holdfast.Client(ep, discover=False, request_timeout=1, attempt_timeout=1) as c:
                        for g in c.status().groups:
                            if g.group == group and g.role == "leader" and g.leader_confirmed:
                                return int(g.leader_id)
                except holdfast.HoldfastError:
                    continue
            time.sleep(0.1)
        raise RuntimeError(f"no confirmed leader of group {group} within 30 s")

    def wait_all_groups_led(self) -> None:
        for g in range(self.groups):
            self.leader_of(g)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # Ctrl-C: `holdfast dev` stops every server
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def cluster() -> Iterator[DevCluster]:
    c = DevCluster()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def client(cluster: DevCluster) -> Iterator[holdfast.Client]:
    # One of the five endpoints: the client learns the others from it.
    with holdfast.Client(cluster.endpoints[0]) as c:
        yield c


@pytest.fixture
def name(request: pytest.FixtureRequest) -> str:
    """A lock name of this test's own."""
    return "py/" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")


class Process:
    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def wait_port(port: int, proc: Process, what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.proc.returncode}) before it listened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def fence_store() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="holdfast-py-fence-")
    port = free_port()
    p = Process([holdfast_bin(), "fence-store", "--listen", f"127.0.0.1:{port}", "--data", f"{d}/fence.log"])
    try:
        wait_port(port, p, "holdfast fence-store")
        yield f"127.0.0.1:{port}"
    finally:
        p.stop()
        shutil.rmtree(d, ignore_errors=True)


def postgres_bin() -> Optional[Path]:
    root = Path("/usr/lib/postgresql")
    found = sorted(p / "bin" for p in root.glob("*") if (p / "bin" / "postgres").exists()) if root.exists() else []
    return found[-1] if found else None


@pytest.fixture(scope="session")
def postgres_dsn() -> Iterator[str]:
    """A throwaway PostgreSQL server (the Debian server binaries, as the Rust fencing test uses). Without
    them the test is skipped, unless HOLDFAST_REQUIRE_POSTGRES=1 (CI sets it), which makes it fail."""
    psycopg = pytest.importorskip("psycopg")
    bin_dir = postgres_bin()
    if bin_dir is None:
        if os.environ.get("HOLDFAST_REQUIRE_POSTGRES") == "1":
            pytest.fail("PostgreSQL server binaries not found under /usr/lib/postgresql")
        pytest.skip("PostgreSQL server binaries not found (apt-get install postgresql)")
    d = tempfile.mkdtemp(prefix="holdfast-py-pg-")
    prefix: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        subprocess.run(["chown", "-R", "postgres:postgres", d], check=True)
        prefix = ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", "--"]
    subprocess.run(
        prefix + [str(bin_dir / "initdb"), "-A", "trust", "-U", "holdfast", "--no-sync", "-D", f"{d}/data"],
        check=True,
        capture_output=True,
    )
    port = free_port()
    p = Process(
        prefix
        + [str(bin_dir / "postgres"), "-D", f"{d}/data", "-p", str(port), "-c", "listen_addresses=127.0.0.1",
           "-c", "fsync=off", "-k", d]
    )
    dsn = f"host=127.0.0.1 port={port} user=holdfast dbname=postgres"
    try:
        end = time.monotonic() + 30
        while True:
            try:
                psycopg.connect(dsn).close()
                break
            except psycopg.OperationalError:
                if time.monotonic() > end or p.proc.poll() is not None:
                    raise
                time.sleep(0.1)
        yield dsn
    finally:
        p.stop()
        shutil.rmtree(d, ignore_errors=True)
