"""Shared fixtures: a valid base config, a writer that puts configs (and data) on disk, and a
headless Chromium for the run report's page."""

from __future__ import annotations

import copy
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from rollout.testing.browser import CHROMIUM, CHROMIUM_ARGS

# Nothing is downloaded: set before anything imports huggingface_hub.
os.environ["HF_HUB_OFFLINE"] = "1"

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
EVAL_SUFFIX = ".eval.toml"
"""Example eval configs (`rollout eval --config`) end so; every other example .toml is a run
config."""


def run_config_examples() -> list[Path]:
    return sorted(p for p in EXAMPLES.rglob("*.toml") if not p.name.endswith(EVAL_SUFFIX))


BASE_CONFIG: dict[str, Any] = {
    "run": {"name": "t", "seed": 1},
    "model": {"builtin": "tiny-llama"},
    "data": {
        "train": {"path": "train.jsonl"},
        "fields": {"prompt": "prompt", "answer": "answer"},
    },
    "algorithm": {"kind": "grpo", "rollout_batch_size": 8, "num_generations": 4, "max_steps": 2},
    "generation": {"max_new_tokens": 8, "max_prompt_tokens": 32},
    "rewards": [{"fn": "numeric_match"}],
    "cluster": {"device": "cpu"},
}

TRAIN_RECORDS = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(16)]


@pytest.fixture(scope="session")
def rollout_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """ROLLOUT_CACHE pointed at a session directory, so builtin models never land in ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        path = tmp_path_factory.mktemp("rollout-cache")
        patch.setenv("ROLLOUT_CACHE", str(path))
        yield path


HUB_ID = "rollout-tests/tiny-llama"
"""The Hub id the hub_cache fixture holds (tiny-llama's weights under another name)."""
COMMITS = ("a" * 40, "b" * 40)


@dataclass(frozen=True)
class HubCache:
    """A Hugging Face hub cache laid out as huggingface_hub writes it: models--org--name/ holding
    blobs/ (files named by content hash), snapshots/<commit>/ (links into blobs) and refs/."""

    root: Path
    source: Path  # the model directory every snapshot holds

    def add(
        self, repo_id: str = HUB_ID, commit: str = COMMITS[0], ref: str | None = "main"
    ) -> Path:
        from rollout.fingerprints import sha256_file

        repo = self.root / f"models--{repo_id.replace('/', '--')}"
        snapshot = repo / "snapshots" / commit
        snapshot.mkdir(parents=True, exist_ok=True)
        (repo / "blobs").mkdir(exist_ok=True)
        for file in sorted(p for p in self.source.iterdir() if p.is_file()):
            blob = repo / "blobs" / sha256_file(file)
            if not blob.exists():
                shutil.copyfile(file, blob)
            link = snapshot / file.name
            if not link.is_symlink():
                link.symlink_to(os.path.relpath(blob, snapshot))
        if ref is not None:
            self.point(ref, commit, repo_id)
        return snapshot

    def point(self, ref: str, commit: str, repo_id: str = HUB_ID) -> None:
        refs = self.root / f"models--{repo_id.replace('/', '--')}" / "refs"
        refs.mkdir(parents=True, exist_ok=True)
        (refs / ref).write_text(commit)  # huggingface_hub writes the sha with no newline


@pytest.fixture
def hub_cache(tmp_path: Path, rollout_cache: Path, monkeypatch: pytest.MonkeyPatch) -> HubCache:
    """An empty hub cache that HF_HUB_CACHE points at; `add` puts tiny-llama in it."""
    from rollout.models.builtin_build import builtin_model_dir

    root = tmp_path / "hf-hub"
    root.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return HubCache(root, builtin_model_dir("tiny-llama"))


@pytest.fixture
def base_config() -> dict[str, Any]:
    return copy.deepcopy(BASE_CONFIG)


def write_toml(path: Path, data: dict[str, Any]) -> Path:
    import tomli_w

    path.write_bytes(tomli_w.dumps(data).encode())
    return path


@pytest.fixture
def config_file(tmp_path: Path) -> Callable[..., Path]:
    """Write a config (dict -> TOML, or raw text) plus train.jsonl next to it; return its path."""

    def write(data: dict[str, Any] | str, name: str = "run.toml") -> Path:
        (tmp_path / "train.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in TRAIN_RECORDS), encoding="utf-8"
        )
        path = tmp_path / name
        if isinstance(data, str):
            path.write_text(data, encoding="utf-8")
        elif name.endswith(".json"):
            path.write_text(json.dumps(data), encoding="utf-8")
        elif name.endswith((".yaml", ".yml")):
            import yaml

            path.write_text(yaml.safe_dump(data), encoding="utf-8")
        else:
            write_toml(path, data)
        return path

    return write


# --- run stores: every run-store test runs against SQLite and Postgres

POSTGRES_TEST_ENV = "ROLLOUT_TEST_PG_DSN"
"""Where the tests' Postgres server is (a libpq DSN); the machines' server by default."""
POSTGRES_TEST_DSN = "host=127.0.0.1 port=5432 dbname=test user=postgres"
STORE_DSN_ENV = "ROLLOUT_PG_DSN"


@pytest.fixture(scope="session")
def postgres_server() -> str:
    """The DSN of a Postgres server the tests may create schemas in; skips, saying why, where
    psycopg is missing or no server answers."""
    dsn = os.environ.get(POSTGRES_TEST_ENV) or POSTGRES_TEST_DSN
    try:
        import psycopg
    except ImportError:
        pytest.skip("psycopg is not installed: pip install 'rollout[postgres]'")
    try:
        psycopg.connect(dsn, connect_timeout=3).close()
    except psycopg.OperationalError as error:
        reason = str(error).strip().splitlines()[0]
        pytest.skip(f"no Postgres server answers at {dsn} (set {POSTGRES_TEST_ENV}): {reason}")
    return dsn


@pytest.fixture
def postgres_location(postgres_server: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`postgres:env:ROLLOUT_PG_DSN`, its DSN naming a fresh schema of this test's own (first in
    search_path), dropped after it. Child processes inherit the variable."""
    import secrets

    import psycopg
    from psycopg import conninfo, sql

    schema = f"rollout_test_{secrets.token_hex(6)}"
    with psycopg.connect(postgres_server, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    monkeypatch.setenv(
        STORE_DSN_ENV, conninfo.make_conninfo(postgres_server, options=f"-csearch_path={schema}")
    )
    try:
        yield f"postgres:env:{STORE_DSN_ENV}"
    finally:
        with psycopg.connect(postgres_server, autocommit=True) as admin:
            # A connection a failed test left in a transaction on this schema's tables must
            # not hang the drop (and only those: other sessions share the server).
            admin.execute(
                "SELECT pg_terminate_backend(locks.pid) FROM pg_locks AS locks "
                "JOIN pg_class ON locks.relation = pg_class.oid "
                "JOIN pg_namespace ON pg_class.relnamespace = pg_namespace.oid "
                "WHERE pg_namespace.nspname = %s AND locks.pid <> pg_backend_pid()",
                [schema],
            )
            admin.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture(params=["sqlite", "postgres"])
def store_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A location for an empty run store, once per backend."""
    if request.param == "postgres":
        return request.getfixturevalue("postgres_location")
    return f"sqlite:{tmp_path / 'runs' / 'rollout.db'}"


# --- Object stores: real protocols on loopback (s3fs against a moto server, gcsfs against
# gcp-storage-emulator). The servers live for the session; each test gets a bucket of its own.
# Their addresses and test credentials go into the environment, where the providers' own
# credential chains (and the workers a run starts) find them: nothing names them in a config.


@dataclass(frozen=True)
class ObjectStore:
    scheme: str
    """'s3' or 'gs'."""
    endpoint: str
    """http://127.0.0.1:PORT."""

    def new_bucket(self) -> str:
        """A fresh, empty bucket's URL: s3://rollout-test-1a2b3c."""
        import secrets

        import fsspec

        bucket = f"rollout-test-{secrets.token_hex(4)}"
        fsspec.filesystem(self.scheme).mkdir(bucket)
        return f"{self.scheme}://{bucket}"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _quiet_werkzeug() -> None:
    import logging

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise


@pytest.fixture(scope="session")
def s3_server() -> Iterator[ObjectStore]:
    """A moto S3 server on 127.0.0.1 (skips, saying why, where moto or s3fs is missing)."""
    pytest.importorskip("s3fs", reason="s3fs is not installed: pip install 'rollout[s3]'")
    server_module = pytest.importorskip(
        "moto.server", reason="moto is not installed: pip install 'moto[server]'"
    )
    _quiet_werkzeug()
    port = _free_port()
    server = server_module.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL_S3=endpoint,
    )
    try:
        yield ObjectStore("s3", endpoint)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[ObjectStore]:
    """A gcp-storage-emulator on 127.0.0.1 (skips, saying why, where it or gcsfs is missing)."""
    pytest.importorskip("gcsfs", reason="gcsfs is not installed: pip install 'rollout[gcs]'")
    emulator = pytest.importorskip(
        "gcp_storage_emulator.server",
        reason="gcp-storage-emulator is not installed: pip install gcp-storage-emulator",
    )
    _quiet_werkzeug()
    port = _free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    # Recent gcsfs probes every bucket's type for 60 s against an emulator unless told not to.
    os.environ.update(STORAGE_EMULATOR_HOST=endpoint, GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT="false")
    try:
        yield ObjectStore("gs", endpoint)
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: ObjectStore) -> str:
    """s3://<a fresh bucket> on the moto server."""
    return s3_server.new_bucket()


@pytest.fixture
def gcs_bucket(gcs_server: ObjectStore) -> str:
    """gs://<a fresh bucket> on the GCS emulator."""
    return gcs_server.new_bucket()


@pytest.fixture(params=["local", "s3", "gs"])
def artifact_root(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Where artifacts go, once per kind of location: a local directory, then a prefix in a
    fresh S3 bucket and in a fresh GCS bucket."""
    if request.param == "s3":
        return request.getfixturevalue("s3_bucket") + "/artifacts"
    if request.param == "gs":
        return request.getfixturevalue("gcs_bucket") + "/artifacts"
    return str(tmp_path / "artifacts")


@pytest.fixture(scope="module")
def browser():
    """Headless Chromium driven by playwright, for run reports (skipped where either is absent)."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install 'rollout[test]'")
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        pytest.skip("no chromium: apt-get install chromium")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
