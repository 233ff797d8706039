"""Start the Triton Inference Server that the ``nvidia-pytriton`` wheel ships
(``pytriton/tritonserver/bin/tritonserver``, Triton 2.51) on a model repository,
bound to 127.0.0.1 (``dash-triton serve`` and the tests).

What launching that binary directly needs (PyTriton does the same in its own launcher):

- a backend folder with the Python backend (``libtriton_python.so``,
  ``triton_python_backend_utils.py``) and the backend *stub* built for the running
  Python version (the wheel keeps one per version under ``python_backend_stubs/``);
  it is assembled in a scratch folder, the wheel is left untouched;
- ``LD_LIBRARY_PATH`` with the wheel's ``nvidia_pytriton.libs`` (the server's own
  shared libraries) and the running interpreter's ``lib`` folder: the stub links
  ``libpython3.X.so`` and must get this interpreter's, not another one on the system;
- ``PATH`` starting with this interpreter's ``bin`` folder: the embedded interpreter
  in the stub finds its ``sys.prefix`` (and so this virtual environment's
  site-packages, with torch and dash-trt) through ``python3`` on ``PATH``;
  ``PYTHONPATH`` also gets the folder holding ``dash_trt``.

No GPU is needed; the server logs that it found no CUDA device and serves CPU models.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass

from ..triton_protocol import DRAIN_ACTION, DRAIN_TOKEN_ENV, ENGINE_CONTROL, GET_STATS, INPUT_IDS, PARAM_ENGINE, STATS

__all__ = [
    "TritonUnavailable",
    "TritonStartError",
    "TritonStartCancelled",
    "TritonPortInUse",
    "TritonDist",
    "find_tritonserver",
    "free_ports",
    "TritonServer",
    "stats_request",
    "served_generation_models",
    "check_launch_names",
    "ADMIN_HEADER",
    "GRPC_ADMIN_HEADER",
    "admin_headers",
    "RESTRICTED_APIS",
    "admin_key_plugin",
    "read_admin_key",
    "write_admin_key",
]

HOST = "127.0.0.1"

#: The request header that carries the admin key (lower case: a gRPC metadata key). Triton's
#: gRPC front end reads it with its own prefix (:data:`GRPC_ADMIN_HEADER`).
ADMIN_HEADER = "dash-admin-key"
GRPC_ADMIN_HEADER = "triton-grpc-protocol-" + ADMIN_HEADER
#: Triton APIs that no client of the generation models needs: refused, on HTTP and gRPC, to a
#: request without the admin key. Shared memory (any /dev/shm object could be registered, then
#: read and written through tensors), model control and the repository index, statistics,
#: trace and logging settings. Health, metadata, model configs and inference stay open.
RESTRICTED_APIS = ("shared-memory", "model-repository", "statistics", "trace", "logging")


def admin_headers(key: str) -> dict[str, str]:
    """The headers that open the restricted APIs over HTTP and gRPC (``headers=`` of
    tritonclient's calls)."""
    return {ADMIN_HEADER: key, GRPC_ADMIN_HEADER: key}


def admin_key_plugin(key: str):
    """A tritonclient plugin (``client.register_plugin(...)``) that sends the admin key with every
    request of a client (HTTP, gRPC or gRPC asyncio)."""
    from tritonclient._plugin import InferenceServerClientPlugin

    class AdminKey(InferenceServerClientPlugin):
        def __call__(self, request):
            request.headers.update(admin_headers(key))

    return AdminKey()


def write_admin_key(path: str, key: str) -> None:
    """Write ``key`` to ``path`` readable by its owner only (0600, whatever the umask), replacing
    a regular file there; a symlink or another kind of file is refused (OSError)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
    fd = os.open(path, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (key + "\n").encode())
    finally:
        os.close(fd)


def read_admin_key(path: str) -> str:
    """The admin key in ``path`` (what ``dash-triton serve --admin-key-file`` wrote)."""
    with open(path, encoding="utf-8") as fh:
        key = fh.read().strip()
    if not key:
        raise ValueError(f"{path} holds no admin key")
    return key


def is_loopback(address: str) -> bool:
    """Whether a bind address is a loopback one (127.0.0.0/8, ::1, localhost)."""
    import ipaddress

    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


class TritonUnavailable(RuntimeError):
    """The bundled tritonserver is not installed or cannot run on this machine."""


class TritonStartError(RuntimeError):
    """The server started but exited or did not become ready; the message holds its log tail."""


class TritonPortInUse(TritonStartError):
    """A port asked for is taken by another process (found before the start, or Triton could not
    bind it)."""


class TritonStartCancelled(TritonStartError):
    """:meth:`TritonServer.start` was cancelled (its ``cancel`` event set, e.g. by SIGTERM) before
    the server was ready; the server was stopped."""


@dataclass(frozen=True)
class TritonDist:
    """Where the wheel's server pieces are."""

    root: str  #: .../pytriton/tritonserver
    binary: str
    python_backend: str  #: folder with libtriton_python.so and triton_python_backend_utils.py
    stub: str  #: triton_python_backend_stub for this Python version
    libs: str  #: nvidia_pytriton.libs


def find_tritonserver() -> TritonDist:
    """Locate the server of the installed ``nvidia-pytriton`` wheel, or raise
    :class:`TritonUnavailable` saying what is missing."""
    import importlib.util

    # Locate the package without importing it: pytriton's __init__ imports its own Python
    # server stack (gevent, zmq, aiohttp, ...), none of which the binary needs.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise TritonUnavailable(
            "the 'nvidia-pytriton' package (which ships the tritonserver binary) is not "
            "installed: pip install nvidia-pytriton"
        )
    if not sys.platform.startswith("linux"):
        raise TritonUnavailable(f"the bundled tritonserver runs on Linux only, this is {sys.platform}")
    pkg = os.path.abspath(list(spec.submodule_search_locations)[0])
    root = os.path.join(pkg, "tritonserver")
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    dist = TritonDist(
        root=root,
        binary=os.path.join(root, "bin", "tritonserver"),
        python_backend=os.path.join(root, "backends", "python"),
        stub=os.path.join(root, "python_backend_stubs", version, "triton_python_backend_stub"),
        libs=os.path.join(os.path.dirname(pkg), "nvidia_pytriton.libs"),
    )
    for what, path in (
        ("tritonserver binary", dist.binary),
        ("Python backend", dist.python_backend),
        (f"Python backend stub for Python {version}", dist.stub),
    ):
        if not os.path.exists(path):
            raise TritonUnavailable(f"nvidia-pytriton has no {what} at {path}")
    if not os.access(dist.binary, os.X_OK):
        raise TritonUnavailable(f"{dist.binary} is not executable")
    return dist


def prepare_backends(dist: TritonDist, folder: str) -> str:
    """Assemble ``folder/python`` (backend library, utils, this Python's stub); returns
    the backend directory to pass as ``--backend-directory``."""
    py = os.path.join(folder, "python")
    os.makedirs(py, exist_ok=True)
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        shutil.copy2(os.path.join(dist.python_backend, name), os.path.join(py, name))
    shutil.copy2(dist.stub, os.path.join(py, "triton_python_backend_stub"))
    return folder


def server_env(dist: TritonDist, base: dict | None = None) -> dict[str, str]:
    env = dict(os.environ if base is None else base)
    libdir = sysconfig.get_config_var("LIBDIR") or os.path.join(sys.base_prefix, "lib")
    parts = [p for p in (dist.libs, libdir, env.get("LD_LIBRARY_PATH", "")) if p]
    env["LD_LIBRARY_PATH"] = ":".join(parts)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH", "")) if p)
    return env


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (free when asked; another process may
    take one before the server binds it, then :meth:`TritonServer.start` retries)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(port: int) -> bool:
    """Whether something already listens on 127.0.0.1:``port`` (a server left running, e.g.
    the orphan of a killed ``dash-triton serve``: its readiness probe would answer for ours)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


_QUOTED = r'"((?:[^"\\]|\\.)*)"'
_CONFIG_STRING = re.compile(
    r"\b(name|default_model_filename)\s*:\s*"
    + _QUOTED
    + r'|key\s*:\s*"(EXECUTION_ENV_PATH)"\s*value\s*:?\s*\{\s*string_value\s*:\s*'
    + _QUOTED
)


def check_launch_names(repository: str, backends: str | None = None) -> None:
    """RepositoryError unless every name that Triton's Python backend writes into the shell
    command starting a model's worker (``bash -c "<stub> <model path> ... <instance name>
    <model folder>"``) is made of safe characters: the repository path, the backend folder,
    each model folder's name and, in a Python-backend model's config.pbtxt, every ``name``
    (the model's, its inputs' and outputs', its instance groups'), ``default_model_filename`` and
    the ``EXECUTION_ENV_PATH`` parameter (a path the shell sources). A ``$(...)`` there would run."""
    from .repository import _SAFE_CHAR, RepositoryError, check_served_path

    def unsafe(text: str) -> str:
        return "".join(sorted(set(_SAFE_CHAR.sub("", text))))

    check_served_path(repository)
    if backends is not None and unsafe(backends):
        raise RepositoryError(
            f"the scratch folder {backends!r} holds {unsafe(backends)!r}, which Triton's Python backend would hand "
            "to a shell: set TMPDIR to a path of letters, digits and . _ / + @ : , = ~ % -"
        )
    for entry in sorted(os.listdir(repository)):
        folder = os.path.join(repository, entry)
        if not os.path.isdir(folder):
            continue
        if unsafe(entry):
            raise RepositoryError(
                f"the model folder {entry!r} in {repository} holds {unsafe(entry)!r}: Triton's Python backend starts "
                "its models through a shell, which would run or split such characters; rename it (letters, digits, "
                "'_' or '-')"
            )
        try:
            with open(os.path.join(folder, "config.pbtxt"), encoding="utf-8", errors="replace") as fh:
                config = fh.read()
        except OSError:
            continue
        if not re.search(r'^\s*backend\s*:\s*"python"', config, re.M):
            continue
        for m in _CONFIG_STRING.finditer(config):
            field, value = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
            if unsafe(value):
                raise RepositoryError(
                    f"{os.path.join(entry, 'config.pbtxt')}: the {field} {value!r} holds {unsafe(value)!r}: Triton's "
                    "Python backend hands it to a shell, which would run or split such characters"
                )


def _socket_inodes_of(pid: int) -> set[int] | None:
    """Inodes of the sockets process ``pid`` holds open (Linux /proc; None elsewhere)."""
    try:
        entries = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    found = set()
    for entry in entries:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{entry}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found.add(int(link[len("socket:[") : -1]))
    return found


def _listening_inodes(port: int) -> set[int]:
    """Inodes of the TCP sockets listening on ``port`` (any address), from /proc/net/tcp{,6}."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as fh:
                rows = fh.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                found.add(int(f[9]))
    return found


def listens_on(pid: int, port: int) -> bool | None:
    """Whether process ``pid`` itself listens on TCP ``port``: another process on that port
    (one that bound it first) does not count. None where /proc cannot tell (not Linux)."""
    mine = _socket_inodes_of(pid)
    if mine is None or not os.path.exists("/proc/net/tcp"):
        return None
    return bool(mine & _listening_inodes(port))


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the server gets SIGTERM when the process that started it dies, even by
    SIGKILL (prctl PR_SET_PDEATHSIG), so no tritonserver outlives its ``serve``."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


_LOAD_FAILED = re.compile(r"failed to load '([^']+)' version (\d+): (.*?)\"?\s*$")


def model_load_errors(log: str, limit: int = 400) -> list[str]:
    """One line per model version the server failed to load, from its log
    (``model 'dash' version 1 failed to load: Internal: CheckpointError: ...``)."""
    out, seen = [], set()
    for line in log.splitlines():
        m = _LOAD_FAILED.search(line)
        if m and (m.group(1), m.group(2)) not in seen:
            seen.add((m.group(1), m.group(2)))
            reason = m.group(3).replace('\\"', '"')
            out.append(
                f"model '{m.group(1)}' version {m.group(2)} failed to load: "
                f"{reason if len(reason) <= limit else reason[:limit] + '...'}"
            )
    return out


def stats_request(client, model: str, decoupled: bool, control: bytes | None = None, timeout: float = 10.0) -> dict:
    """One statistics-answering request (``get_stats``, or ``engine_control`` with ``control``)
    to a generation model over gRPC (``client``: a ``tritonclient.grpc`` client); a decoupled
    model answers it on a stream. Returns the engine's statistics; raises what the client
    raised (a dead worker: INTERNAL "Stub process ... is not healthy")."""
    import json as _json
    import queue

    import numpy as np
    import tritonclient.grpc as grpcclient

    ids = grpcclient.InferInput(INPUT_IDS, [0], "INT64")
    ids.set_data_from_numpy(np.zeros(0, dtype=np.int64))
    if control is not None:
        extra = grpcclient.InferInput(ENGINE_CONTROL, [len(control)], "UINT8")
        extra.set_data_from_numpy(np.frombuffer(control, dtype=np.uint8))
    else:
        extra = grpcclient.InferInput(GET_STATS, [1], "BOOL")
        extra.set_data_from_numpy(np.array([True]))
    if not decoupled:
        result = client.infer(model, [ids, extra], client_timeout=timeout)
    else:
        answers: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(model, [ids, extra])
            try:
                result, error = answers.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"no answer from {model} within {timeout:g} s") from None
        finally:
            client.stop_stream()
        if error is not None:
            raise error
    return _json.loads(result.as_numpy(STATS).astype(np.uint8).tobytes().decode())


def served_generation_models(client, headers: dict[str, str] | None = None) -> dict[str, bool]:
    """The generation models a running server has loaded (name -> decoupled), from its
    repository index (a restricted API: ``headers`` carries the admin key) and model configs
    over gRPC: Python-backend models whose config carries the engine configuration parameter
    (what ``dash-triton write`` writes)."""
    found = {}
    for entry in client.get_model_repository_index(headers=headers, as_json=True).get("models", []):
        if entry.get("state") != "READY":
            continue
        config = client.get_model_config(entry["name"], as_json=True).get("config", {})
        if config.get("backend") == "python" and PARAM_ENGINE in config.get("parameters", {}):
            found[entry["name"]] = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    return found


def _shm_regions_mapped_by(pid: int) -> set[str]:
    """Names of the /dev/shm files that process ``pid`` maps (Linux; empty elsewhere)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as fh:
            return {line.split("/dev/shm/", 1)[1].split()[0] for line in fh if "/dev/shm/" in line}
    except OSError:
        return set()


def _shm_regions_mapped_anywhere() -> set[str]:
    found: set[str] = set()
    if os.path.isdir("/proc"):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                found |= _shm_regions_mapped_by(int(entry))
    return found


def process_info(pid: int) -> tuple[int, list[bytes]] | None:
    """(parent pid, command line) of a live process from /proc; None when it is gone or has
    exited (a zombie not yet reaped), or off Linux."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[-1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmdline = fh.read().split(b"\0")
    except OSError:
        return None
    return None if len(fields) < 2 or fields[0] == "Z" else (int(fields[1]), cmdline)


def _is_stub(pid: int, model: str) -> bool:
    """Whether ``pid`` is still a live model worker of ``model`` (its cmdline: the backend stub
    and the model's file; a recycled pid is not)."""
    info = process_info(pid)
    return info is not None and b"stub" in os.path.basename(info[1][0]) and (not model or model.encode() in info[1])


class TritonServer:
    """A ``tritonserver`` process serving ``repository``, on 127.0.0.1 (gRPC always; HTTP
    unless ``http_address`` says otherwise).

    ``http_port``/``grpc_port`` 0 pick free ports. Use as a context manager, or
    :meth:`start` then :meth:`stop`. The server's log goes to ``log_path`` (a file in
    a scratch folder by default; :meth:`log_tail` reads it).

    The APIs of :data:`RESTRICTED_APIS` answer only requests that carry :attr:`admin_key` in
    the :data:`ADMIN_HEADER` header (random unless given); with ``key_http_inference`` HTTP
    inference does too (Triton 2.51's HTTP front end crashes on some request shapes: gRPC
    refuses them).
    """

    def __init__(
        self,
        repository: str,
        *,
        http_port: int = 0,
        grpc_port: int = 0,
        metrics_port: int | None = None,
        log_path: str | None = None,
        verbose: int = 0,
        exit_timeout: int = 20,
        extra_args: Sequence[str] = (),
        http_address: str = HOST,
        admin_key: str | None = None,
        key_http_inference: bool = False,
    ):
        self.repository = os.path.abspath(repository)
        if not os.path.isdir(self.repository):
            raise FileNotFoundError(f"model repository not found: {self.repository}")
        self.dist = find_tritonserver()
        self._want = (http_port, grpc_port, metrics_port)
        self.http_port = self.grpc_port = 0
        self.metrics_port = metrics_port
        self.verbose, self.exit_timeout, self.extra_args = verbose, exit_timeout, list(extra_args)
        self._scratch = tempfile.mkdtemp(prefix="dash-tritonserver-")
        try:  # what reaches the shell that starts each model's worker (RepositoryError)
            check_launch_names(self.repository, self._scratch)
        except ValueError:
            shutil.rmtree(self._scratch, ignore_errors=True)
            raise
        self.log_path = log_path or os.path.join(self._scratch, "tritonserver.log")
        self.backends = prepare_backends(self.dist, os.path.join(self._scratch, "backends"))
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._started_workers: dict[int, str] = {}
        self._shm_regions: set[str] = set()
        #: what :meth:`stop` removed after a server that died without cleaning up: orphaned
        #: model workers killed, shared-memory regions unlinked
        self.leftovers: dict[str, list] = {"workers": [], "shm": []}
        #: passed to the server's processes (DRAIN_TOKEN_ENV): the generation models serve the
        #: drain control only with it (:meth:`drain`)
        self.drain_token = secrets.token_hex(16)
        self.http_address = http_address
        self.admin_key = admin_key or secrets.token_urlsafe(32)
        if not re.fullmatch(r"[A-Za-z0-9_-]{16,128}", self.admin_key):
            raise ValueError("an admin key is 16..128 letters, digits, '_' or '-'")
        self.key_http_inference = key_http_inference

    # ------------------------------------------------------------------ urls
    @property
    def http_host(self) -> str:
        """Where a client on this machine reaches the HTTP front end."""
        if self.http_address in ("0.0.0.0", "::", ""):
            return HOST
        return f"[{self.http_address}]" if ":" in self.http_address else self.http_address

    @property
    def http_url(self) -> str:
        return f"{self.http_host}:{self.http_port}"

    @property
    def admin_headers(self) -> dict[str, str]:
        """The headers that open the restricted APIs (``headers=`` of tritonclient's calls)."""
        return admin_headers(self.admin_key)

    @property
    def grpc_url(self) -> str:
        return f"{HOST}:{self.grpc_port}"

    def command(self) -> list[str]:
        cmd = [
            self.dist.binary,
            f"--model-repository={self.repository}",
            f"--backend-directory={self.backends}",
            f"--http-address={self.http_address}",
            f"--http-port={self.http_port}",
            f"--grpc-address={HOST}",
            f"--grpc-port={self.grpc_port}",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.verbose}",
            # tritonserver takes the keys on its command line only (no file or environment)
            f"--http-restricted-api={','.join(self.http_restricted)}:{ADMIN_HEADER}={self.admin_key}",
            f"--grpc-restricted-protocol={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}={self.admin_key}",
        ]
        if self.metrics_port is None:
            cmd.append("--allow-metrics=false")
        else:
            cmd += [
                "--allow-metrics=true",
                "--allow-gpu-metrics=false",
                f"--metrics-address={HOST}",
                f"--metrics-port={self.metrics_port}",
            ]
        return cmd + self.extra_args

    @property
    def http_restricted(self) -> tuple[str, ...]:
        """The HTTP APIs that need the admin key."""
        return RESTRICTED_APIS + (("inference",) if self.key_http_inference else ())

    # ------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 180.0, cancel: threading.Event | None = None) -> TritonServer:
        """Start and wait until the server and every model are ready. Retries once with
        other ports if one was taken in the meantime. ``cancel`` set while it waits (a model
        can hang at load) kills the server and raises :class:`TritonStartCancelled`."""
        for attempt in range(2):
            http, grpc, metrics = self._want
            if not http or not grpc:
                ports = free_ports(3)
                http, grpc = http or ports[0], grpc or ports[1]
                if metrics == 0:
                    metrics = ports[2]
            self.http_port, self.grpc_port, self.metrics_port = http, grpc, metrics
            taken_now = [p for p in self._want if p and port_in_use(p)]  # the ports asked for
            if taken_now:
                raise TritonPortInUse(
                    f"port {', '.join(map(str, taken_now))} on {HOST} is already in use (another server, or one "
                    f"left running by a killed dash-triton serve: stop it, or pick other ports)"
                )
            self._log = open(self.log_path, "ab")
            self.proc = subprocess.Popen(
                self.command(),
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**server_env(self.dist), DRAIN_TOKEN_ENV: self.drain_token},
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
            try:
                self.wait_ready(timeout, cancel)
                # what to clean up should the server die without doing it itself (kill -9, a
                # crash): its model workers and their shared-memory regions
                self._started_workers.update(self.workers())
                self._shm_regions |= _shm_regions_mapped_by(self.proc.pid)
                return self
            except TritonStartCancelled:
                self.stop(kill=True)  # nothing is served yet; a model hanging at load ignores SIGINT
                raise
            except TritonStartError as exc:
                taken = "already in use" in self.log_tail(4000).lower()
                self.stop()
                if not (taken and attempt == 0 and not all(self._want[:2])):
                    if taken:
                        raise TritonPortInUse(str(exc)) from None
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start_error(self, what: str) -> TritonStartError:
        """``what`` plus why: the models' load errors from the log where there are any (else
        its tail), and where the log is kept (a copy outside the scratch folder, which
        :meth:`cleanup` removes)."""
        try:
            with open(self.log_path, "rb") as fh:
                text = fh.read().decode("utf-8", "replace")
        except OSError:
            text = ""
        kept = self.log_path
        if text and os.path.dirname(os.path.abspath(self.log_path)) == self._scratch:
            fd, kept = tempfile.mkstemp(prefix="dash-tritonserver-", suffix=".log")
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write(text)
        errors = model_load_errors(text)
        if errors:
            return TritonStartError(f"{what}: " + "; ".join(errors) + f" (server log: {kept})")
        return TritonStartError(f"{what}; log {kept}:\n{self.log_tail()}")

    def wait_ready(self, timeout: float = 180.0, cancel: threading.Event | None = None) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.http_url}/v2/health/ready"
        cancel = cancel or threading.Event()
        while time.monotonic() < deadline:
            if cancel.is_set():
                raise TritonStartCancelled("stopped before the server was ready")
            code = self.proc.poll() if self.proc else -1
            if code is not None:
                raise self._start_error(f"tritonserver exited with code {code} before it was ready")
            # what it has started so far, for the clean-up should it exit without doing it
            self._started_workers.update(self.workers())
            self._shm_regions |= _shm_regions_mapped_by(self.proc.pid)
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    # bind, then announce: ready only once the ports are this server's (the
                    # answer may come from another server that took a port first; this one then
                    # fails to bind it and exits)
                    if r.status == 200 and self._holds_ports():
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            cancel.wait(0.2)
        raise self._start_error(f"tritonserver not ready after {timeout:.0f} s")

    def _holds_ports(self) -> bool:
        """Whether the server process itself listens on its HTTP, gRPC and metrics ports (True
        where /proc cannot tell)."""
        ports = [self.http_port, self.grpc_port] + ([self.metrics_port] if self.metrics_port else [])
        return all(listens_on(self.proc.pid, port) is not False for port in ports)

    def stop(self, timeout: float = 45.0, *, kill: bool = False) -> int | None:
        """SIGINT (Triton unloads the models, whose ``finalize`` answers what is still
        queued), then SIGKILL if it does not exit within ``timeout``; with ``kill``, SIGKILL at
        once (a server whose model worker died would wait for requests the dead worker never
        answers: killing it closes their connections, so their clients get UNAVAILABLE now).
        Then removes what a server that died uncleanly leaves (:attr:`leftovers`). Returns the
        exit code."""
        if self.proc is not None and self.proc.poll() is None:
            # what it has started (a model loading when stopped before ready included), for the
            # clean-up should it not do it itself
            self._started_workers.update(self.workers())
            self._shm_regions |= _shm_regions_mapped_by(self.proc.pid)
        proc, self.proc = self.proc, None
        code = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGINT)
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
            code = proc.returncode
            self._remove_leftovers()
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def _remove_leftovers(self) -> None:
        """After the server exited: a model worker (Python-backend stub) still running is an
        orphan (a server killed by SIGKILL leaves them holding the model's memory until their
        own parent check notices), and a shared-memory region of the server's that no process
        maps any more is garbage (Triton unlinks them on a clean shutdown, not after a crash).
        Both are removed and listed in :attr:`leftovers`."""
        workers, self._started_workers = self._started_workers, {}
        regions, self._shm_regions = self._shm_regions, set()
        orphans = [pid for pid, model in workers.items() if _is_stub(pid, model)]
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while any(_is_stub(pid, workers[pid]) for pid in orphans) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.leftovers["workers"] += orphans
        if not regions:
            return
        mapped = _shm_regions_mapped_anywhere()
        for name in sorted(regions - mapped):
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                continue
            except OSError:
                continue
            self.leftovers["shm"].append(name)

    def generation_models(self) -> dict[str, bool]:
        """The repository's generation models (name -> decoupled): Python-backend models whose
        config.pbtxt carries the engine configuration parameter (what ``dash-triton write``
        writes)."""
        found = {}
        for entry in sorted(os.listdir(self.repository)):
            path = os.path.join(self.repository, entry, "config.pbtxt")
            try:
                with open(path, encoding="utf-8") as fh:
                    text = fh.read()
            except OSError:
                continue
            name = re.search(r'^name:\s*"([^"]+)"', text, re.M)
            if name and re.search(r'^backend:\s*"python"', text, re.M) and f'key: "{PARAM_ENGINE}"' in text:
                found[name.group(1)] = bool(re.search(r"decoupled:\s*true", text))
        return found

    def drain(self, grace: float = 5.0, timeout: float | None = None) -> tuple[bool, list[str]]:
        """Graceful shutdown of the generation models, while the server still answers: each
        refuses new requests, answers its queued ones UNAVAILABLE, gives the running ones
        ``grace`` seconds and then answers them UNAVAILABLE too. Waits (up to ``timeout``,
        default grace + 10 s) until no model holds a request. Returns (all drained, notes)."""
        import tritonclient.grpc as grpcclient

        notes, models = [], self.generation_models()
        control = f"{DRAIN_ACTION} {self.drain_token} {grace:g}".encode()
        pending = set()
        with grpcclient.InferenceServerClient(self.grpc_url) as client:
            for model, decoupled in models.items():
                try:
                    stats_request(client, model, decoupled, control)
                    pending.add(model)
                except Exception as exc:  # noqa: BLE001 - reported, the shutdown goes on
                    notes.append(f"{model}: drain not delivered ({type(exc).__name__}: {exc})")
            deadline = time.monotonic() + (grace + 10.0 if timeout is None else timeout)
            while pending and time.monotonic() < deadline:
                for model in sorted(pending):
                    try:
                        st = stats_request(client, model, models[model])
                    except Exception:  # noqa: BLE001 - asked again until the deadline
                        continue
                    if st.get("running", 1) == 0 and st.get("waiting", 1) == 0:
                        pending.discard(model)
                if pending:
                    time.sleep(0.2)
        notes += [f"{m}: still held requests after the drain" for m in sorted(pending)]
        return not notes, notes

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The server process's exit code (negative: the signal that ended it); None while it
        runs or when none was started."""
        return None if self.proc is None else self.proc.poll()

    def workers(self) -> dict[int, str]:
        """The server's Python-backend stub processes (one per model instance): pid -> name,
        from /proc (Linux; empty elsewhere or when none runs)."""
        if self.proc is None or not os.path.isdir("/proc"):
            return {}
        found = {}
        for entry in filter(str.isdigit, os.listdir("/proc")):
            info = process_info(int(entry))
            if info is not None and info[0] == self.proc.pid and b"stub" in os.path.basename(info[1][0]):
                found[int(entry)] = next(
                    (c.decode(errors="replace") for c in info[1][1:] if c.endswith(b"/model.py")), ""
                )
        return found

    def log_tail(self, chars: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - chars))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def cleanup(self) -> None:
        """Stop and remove the scratch folder (keeps a log_path given by the caller)."""
        self.stop()
        shutil.rmtree(self._scratch, ignore_errors=True)

    def __enter__(self) -> TritonServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.cleanup()
