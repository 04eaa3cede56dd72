"""Object stores (s3://, gs://) as the planner meets them: opened so that a dead endpoint fails in
seconds, and every way a request fails told in words.

Reading a data file, writing a probe object: both first touch a store at plan time, where an
unreachable endpoint must not hang the plan for minutes (botocore retries a dead host for about a
minute by default, gcsfs backs off for half a minute), and where "no such bucket", "wrong
credentials", "may not write" and "no answer" each need a different fix. The SDKs' exception
types are matched by name, so the planner imports no cloud SDK; fsspec builds the filesystem.
Credentials come from the providers' own chains; messages pass through `Issue`, which redacts
anything that looks like one.
"""

from __future__ import annotations

import os
from typing import Any

from rollout.errors import Issue

DEADLINE_SECONDS = 10.0
"""The most one call to a store (a write, a removal, an existence check) may take at plan time
before the endpoint counts as silent."""

OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oci", "oss"})
"""Schemes of object stores: places for files, not for services such as an MLflow server."""

_S3 = ("s3", "s3a")
_GCS = ("gs", "gcs")


def _quick_options(protocol: str) -> dict[str, Any]:
    """Filesystem options that make a dead endpoint fail fast: one attempt, short connect and
    read timeouts. Other filesystems get their defaults (and the deadline)."""
    if protocol in _S3:
        retries = {"max_attempts": 1, "mode": "standard"}
        return {"config_kwargs": {"connect_timeout": 5, "read_timeout": 10, "retries": retries}}
    if protocol in _GCS:
        return {"requests_timeout": 10}
    return {}


_REACH = {
    "EndpointConnectionError",
    "ConnectionError",
    "ConnectionRefusedError",
    "ClientConnectorError",
    "ClientConnectionError",
    "ServerDisconnectedError",
    "gaierror",
}
_SILENT = {"FSTimeoutError", "TimeoutError", "ConnectTimeoutError", "ReadTimeoutError"}
_NO_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "DefaultCredentialsError"}
_REFUSED_CODES = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "InvalidToken",
    "ExpiredToken",
    "InvalidClientTokenId",
}


def scheme(location: str) -> str:
    return location.split("://", 1)[0].lower()


def quick_filesystem(url: str) -> tuple[Any, str, dict[str, Any]]:
    """(filesystem, path, call options) for `url`: a fresh filesystem (not fsspec's cached one,
    which the runtime may share) that fails fast, and the options that bound each call by
    DEADLINE_SECONDS (async filesystems only: fsspec's sync takes a timeout)."""
    import fsspec

    protocol = scheme(url)
    fs, path = fsspec.core.url_to_fs(url, skip_instance_cache=True, **_quick_options(protocol))
    if protocol in _S3:
        fs.retries = 1  # s3fs retries timeouts 5 times itself, on top of botocore's attempts
    bounded = {"timeout": DEADLINE_SECONDS} if getattr(fs, "async_impl", False) else {}
    return fs, path, bounded


def failure_issue(
    error: BaseException, location: str, key: str, *, doing: str, writing: bool
) -> Issue:
    """One Issue for a failed request to the store holding `location`: what went wrong, where,
    and what to change. `doing` says what was tried ("write checkpoints under", "read")."""
    protocol = scheme(location)
    bucket = location.split("://", 1)[1].split("/", 1)[0]
    names, code, status = _names(error), _error_code(error), getattr(error, "code", None)
    endpoint = _endpoint(protocol)
    where = f" at {endpoint}" if endpoint else ""
    store = {**dict.fromkeys(_S3, "S3"), **dict.fromkeys(_GCS, "GCS")}.get(protocol, protocol)
    if names & _SILENT:
        return Issue(
            key,
            f"no answer from the {store} endpoint{where} within {DEADLINE_SECONDS:g} s when "
            f"trying to {doing} {location}",
            value=location,
            hint=_endpoint_hint(protocol),
        )
    if names & _REACH:
        return Issue(
            key,
            f"cannot reach the {store} endpoint{where} to {doing} {location}: {_first_line(error)}",
            value=location,
            hint=_endpoint_hint(protocol),
        )
    if names & _NO_CREDENTIALS:
        return Issue(
            key,
            f"no credentials were found to {doing} {location}",
            value=location,
            hint=_credentials_hint(protocol),
        )
    if code == "NoSuchBucket" or (writing and "FileNotFoundError" in names):
        return Issue(
            key,
            f"the bucket {bucket!r} does not exist{where}",
            value=location,
            hint=f"create it ({_create_bucket(protocol, bucket)}) or correct the bucket name",
        )
    if code in _REFUSED_CODES or status == 401:
        return Issue(
            key,
            f"the {store} endpoint{where} refused the credentials in use ({code or 401}) when "
            f"trying to {doing} {location}",
            value=location,
            hint=_credentials_hint(protocol),
        )
    if (
        "PermissionError" in names
        or code in ("AccessDenied", "AllAccessDisabled")
        or status == 403
        or str(error).startswith("Forbidden")
    ):
        grant = (
            "s3:PutObject and s3:DeleteObject, or roles/storage.objectAdmin on GCS"
            if writing
            else "s3:GetObject and s3:ListBucket, or roles/storage.objectViewer on GCS"
        )
        return Issue(
            key,
            f"the credentials in use may not {doing} {location} (access denied)",
            value=location,
            hint=f"grant them access to the bucket ({grant}), or use credentials that have it",
        )
    return Issue(
        key,
        f"cannot {doing} {location}: {type(error).__name__}: {_first_line(error)}",
        value=location,
        hint="check the location, the credentials and the endpoint",
    )


def _names(error: BaseException) -> set[str]:
    """The class names of `error`, of its causes and of their base classes."""
    names: set[str] = set()
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        names.update(cls.__name__ for cls in type(current).__mro__)
        current = current.__cause__ or current.__context__
    return names


def _error_code(error: BaseException) -> str | None:
    """An S3 error code ("NoSuchBucket", "AccessDenied") from botocore's ClientError, which
    s3fs keeps as the cause of the OSError it raises."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict) and response.get("Error", {}).get("Code"):
            return str(response["Error"]["Code"])
        current = current.__cause__ or current.__context__
    return None


def _endpoint(protocol: str) -> str | None:
    """The endpoint the provider's chain points at, when the environment names one."""
    if protocol in _S3:
        return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if protocol in _GCS:
        return os.environ.get("STORAGE_EMULATOR_HOST")
    return None


def _endpoint_hint(protocol: str) -> str:
    if protocol in _S3:
        return (
            "check the network and the endpoint (AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, or the "
            "profile's endpoint_url), or unset it to use AWS itself"
        )
    if protocol in _GCS:
        return "check the network, and STORAGE_EMULATOR_HOST if an emulator is meant"
    return "check the network and the endpoint"


def _credentials_hint(protocol: str) -> str:
    if protocol in _S3:
        return (
            "supply AWS credentials the usual way (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or an instance role), never in the config"
        )
    if protocol in _GCS:
        return (
            "supply Google credentials the usual way (gcloud auth application-default login, or "
            "GOOGLE_APPLICATION_CREDENTIALS naming a key file), never in the config"
        )
    return "supply credentials through the filesystem's usual environment, never in the config"


def _create_bucket(protocol: str, bucket: str) -> str:
    if protocol in _GCS:
        return f"gcloud storage buckets create gs://{bucket}"
    if protocol in _S3:
        return f"aws s3 mb s3://{bucket}"
    return "with the provider's tools"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
