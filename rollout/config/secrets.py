"""Secret references: a config names where a secret lives, never the secret itself.

A secret field accepts only ``env:NAME`` (read from the environment at run time) or
``file:/path`` (read from a file at run time). Anything else, in particular something that looks
like a password, token or DSN with a password, is an error at validate time, so a credential never
reaches a config file, a plan.lock or a log.
"""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field

from rollout.files import SECRET_REF
from rollout.redact import redact_text


def check_secret_ref(value: str) -> str:
    if SECRET_REF.match(value):
        return value
    if value.startswith("env:"):
        raise ValueError(
            f"{value!r} is not a valid environment reference: write env:NAME where NAME is "
            "letters, digits and underscores"
        )
    raise ValueError(
        "secrets are never written into a config: put the value in an environment variable and "
        "write 'env:NAME' (or 'file:/path/to/secret')"
    )


def check_no_inline_credentials(value: str) -> str:
    """Reject URLs that carry a password (``s3://key:secret@bucket``, ``postgres://u:pw@host``)."""
    if "://" in value:
        parts = urlsplit(value)
        if parts.password:
            raise ValueError(
                "this URL carries a password: remove it and supply credentials through the "
                "environment (an env: reference or the provider's usual variables)"
            )
    return value


SecretRef = Annotated[
    str,
    AfterValidator(check_secret_ref),
    Field(json_schema_extra={"pattern": SECRET_REF.pattern}),
]
"""A reference to a secret: ``env:NAME`` or ``file:/path``. Never the secret itself."""

Location = Annotated[str, AfterValidator(check_no_inline_credentials)]
"""A local path or fsspec URL (file://, s3://, gs://, ...) with no password inside it."""


def check_local_path(value: str) -> str:
    """Refuse a URL where only a local path works (it would become a directory named 's3:')."""
    if "://" in value and not value.startswith("file://"):
        raise ValueError(
            "must be a local path, not a URL: this is read and written on the machine that runs "
            "the run (checkpoints can go to a URL: storage.artifacts)"
        )
    return value


LocalPath = Annotated[str, AfterValidator(check_local_path)]
"""A path on this machine (file:// allowed): never a URL that would become a local name."""


def redact(value: str) -> str:
    """Return ``value`` with any credential in it replaced by ``***`` (for logs and messages)."""
    return redact_text(value)
