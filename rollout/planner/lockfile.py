"""plan.lock: a Plan as canonical JSON with its sha256, refused when edited, unknown or stale.

The file is {"format", "format_version", "sha256", "plan"}, written deterministically (sorted keys,
two-space indent, UTF-8, trailing newline), so one Plan always gives the same bytes. The sha256
covers the canonical (compact) JSON of everything but itself. Reading re-serializes what it read
and compares bytes as well, so a change of whitespace or key order counts as an edit too: a plan is
changed by changing the config and planning again, never by hand.

Staleness is checked without importing plugins or torch: distribution versions come from package
metadata, files are compared by sha256, a Hub model's revision is looked up in the local cache.
"""

from __future__ import annotations

import json
import math
import os
import secrets
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout.config.model import DEFAULT_REVISION
from rollout.config.plain import deeper_than
from rollout.errors import Issue, LockfileError
from rollout.files import FileRefused, is_url, read_capped
from rollout.fingerprints import sha256_bytes, sha256_file, short_hash
from rollout.models import hub
from rollout.planner.definition import FORMAT_VERSION, Plan, Versions
from rollout.plugins.identity import VersionLookup, installed_version, plugin_changes

FORMAT = "rollout.plan"

# A plan.lock is a few KiB. The cap only keeps a wrong file from being read into memory whole.
MAX_PLAN_BYTES = 64 << 20
# A plan nests its config (at most config.plain.MAX_DEPTH levels) a few levels down.
MAX_PLAN_DEPTH = 128

# Distributions whose version shapes what a run does; any change makes the plan stale.
VERSIONED = ("rollout", "torch", "transformers", "vllm")


def canonical_json(value: Any) -> str:
    """The one JSON text of ``value`` the hash is taken over: sorted keys, no spaces, no NaN."""
    return json.dumps(
        value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


# ---------------------------------------------------------------------------------------------
# writing


def write_plan(plan: Plan, path: str | Path) -> None:
    """Write ``plan`` to ``path`` atomically: a reader sees the old file or the new, never half."""
    path = Path(path)
    content = plan.model_dump(mode="json")
    where = _non_finite(content)
    if where is not None:
        raise LockfileError(
            Issue(
                where,
                "is NaN or infinite, which JSON (and so plan.lock) cannot store",
                hint="use a finite number in the config",
            ),
            source=str(path),
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, _serialize(content))


def _serialize(content: dict[str, Any]) -> bytes:
    body = {"format": FORMAT, "format_version": FORMAT_VERSION, "plan": content}
    document = {**body, "sha256": sha256_bytes(canonical_json(body).encode())}
    text = json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False)
    return (text + "\n").encode()


def _write_atomically(path: Path, data: bytes) -> None:
    temp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    # A fresh name (O_EXCL) in the same directory, so os.replace is a rename on one filesystem;
    # mode 0o666 lets the umask decide permissions, as for any other new file.
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    fd = os.open(temp, flags, 0o666)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def _non_finite(value: Any, path: str = "") -> str | None:
    """Dotted path of the first NaN or infinity in ``value``, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "(plan)"
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, list):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return None
    return next((found for sub, item in items if (found := _non_finite(item, sub))), None)


# ---------------------------------------------------------------------------------------------
# reading


def read_plan(
    path: str | Path, *, check_fresh: bool = True, version_of: VersionLookup = installed_version
) -> Plan:
    """Read and verify plan.lock; refuse one that is missing, edited, of another format or stale."""
    path = Path(path)
    raw = _read_bytes(path)
    document = _parse(raw, path)
    replan = _replan_hint(document, path)
    _check_format(document, path, replan)
    _check_integrity(document, raw, path, replan)
    plan = _validate(document["plan"], path, replan)
    if check_fresh:
        reasons = stale_reasons(plan, version_of=version_of)
        if reasons:
            raise LockfileError([replace(r, hint=replan) for r in reasons], source=str(path))
    return plan


def _refuse(path: Path, message: str, hint: str) -> LockfileError:
    return LockfileError(Issue(path.name, message, hint=hint), source=str(path))


def _read_bytes(path: Path) -> bytes:
    try:
        return read_capped(path, limit=MAX_PLAN_BYTES, what="a plan.lock")
    except FileNotFoundError:
        raise _refuse(
            path, "no plan file here", f"create it with `rollout plan --config CONFIG -o {path}`"
        ) from None
    except FileRefused as exc:  # a FIFO, a device, a directory, a huge file: never read
        raise _refuse(path, exc.reason, "pass the plan.lock `rollout plan` wrote") from None
    except OSError as exc:
        raise _refuse(
            path, f"cannot be read: {exc.strerror}", "pass the plan.lock `rollout plan` wrote"
        ) from None


def _parse(raw: bytes, path: Path) -> Any:
    hint = "pass the plan.lock `rollout plan` wrote; was this one truncated or edited?"
    try:
        document = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
        if deeper_than(document, MAX_PLAN_DEPTH):
            raise RecursionError  # the checks below recurse too, some in Python
        return document
    except UnicodeDecodeError:
        raise _refuse(path, "is not a rollout plan: it is not UTF-8 text", hint) from None
    except json.JSONDecodeError as exc:
        where = f"line {exc.lineno}, column {exc.colno}"
        raise _refuse(path, f"is not valid JSON: {exc.msg} at {where}", hint) from None
    except RecursionError:  # json.loads recurses once per nested array or object
        raise _refuse(path, "is not a rollout plan: its JSON is nested too deeply", hint) from None
    except ValueError as exc:
        if "Exceeds the limit" in str(exc):  # CPython's int digit limit, ~4300 digits
            raise _refuse(path, "is not a rollout plan: it holds a number too long", hint) from None
        raise _refuse(path, f"is not valid JSON: {exc}", hint) from None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _replan_hint(document: Any, path: Path) -> str:
    """What to run to get a good plan again, naming the config the plan was made from."""
    content = document.get("plan") if isinstance(document, dict) else None
    config = content.get("config_path") if isinstance(content, dict) else None
    return f"re-run `rollout plan --config {config or 'CONFIG'} -o {path}`"


def _check_format(document: Any, path: Path, replan: str) -> None:
    if not (
        isinstance(document, dict)
        and document.get("format") == FORMAT
        and isinstance(document.get("plan"), dict)
    ):
        raise _refuse(
            path,
            f'is not a rollout plan (no "format": "{FORMAT}" with a "plan")',
            "pass the plan.lock `rollout plan` wrote",
        )
    version = document.get("format_version")
    if type(version) is not int:
        raise _refuse(path, f"has no valid format_version (got {version!r})", replan)
    ours = f"this rollout ({installed_version('rollout')}) reads plan format {FORMAT_VERSION}"
    if version > FORMAT_VERSION:
        writer = _recorded_rollout_version(document)
        by = f" by rollout {writer}" if writer else " by a newer rollout"
        upgrade = f"rollout>={writer}" if writer else "a newer rollout"
        raise _refuse(
            path,
            f"was written in plan format {version}{by}; {ours}",
            f"install {upgrade}, or {replan} with this rollout",
        )
    if version < FORMAT_VERSION:
        raise _refuse(path, f"uses plan format {version}, older than {ours}", replan)


def _recorded_rollout_version(document: dict[str, Any]) -> str | None:
    versions = document["plan"].get("versions")
    return versions.get("rollout") if isinstance(versions, dict) else None


def _check_integrity(document: dict[str, Any], raw: bytes, path: Path, replan: str) -> None:
    recorded = document.get("sha256")
    body = {key: document[key] for key in ("format", "format_version", "plan")}
    try:
        actual = sha256_bytes(canonical_json(body).encode())
    except ValueError:  # NaN or infinity: rollout never writes them
        actual = None
    if actual is None or recorded != actual:
        raise _refuse(
            path,
            "was edited after planning: its sha256 does not match its content",
            f"change the config instead, then {replan}",
        )
    # The hash covers the content, not the layout; equal bytes also rule out edited whitespace,
    # reordered or duplicated keys, and keys added beside the hashed ones.
    if _serialize(document["plan"]) != raw:
        raise _refuse(
            path,
            "was edited after planning: its bytes differ from what `rollout plan` writes "
            "(whitespace, key order or added keys)",
            f"change the config instead, then {replan}",
        )


def _validate(content: dict[str, Any], path: Path, replan: str) -> Plan:
    try:
        return Plan.model_validate(content)
    except RecursionError:  # a hand-made file that hashes right yet nests past any real plan
        raise _refuse(path, "does not hold a valid plan: it is nested too deeply", replan) from None
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        first = errors[0]
        where = ".".join(str(part) for part in first["loc"]) or "(plan)"
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        raise _refuse(
            path, f"does not hold a valid plan: {where}: {first['msg']}{more}", replan
        ) from None


# ---------------------------------------------------------------------------------------------
# staleness


def stale_reasons(plan: Plan, *, version_of: VersionLookup = installed_version) -> list[Issue]:
    """Everything that changed since ``plan`` was made; empty when it can still run as planned."""
    reasons = [
        change
        for identity in plan.plugins
        for change in plugin_changes(identity, version_of=version_of)
    ]
    reasons += _version_changes(plan.versions, version_of)
    reasons += _model_changes(plan)
    reasons += _data_changes(plan)
    reasons += _suite_changes(plan)
    reasons += _config_changes(plan)
    return reasons


def _version_changes(versions: Versions, version_of: VersionLookup) -> list[Issue]:
    issues = []
    for name in VERSIONED:
        planned, now = getattr(versions, name), version_of(name)
        if planned != now:
            was, became = planned or "not installed", now or "not installed"
            issues.append(Issue(f"versions.{name}", f"{name} {was} → {became}"))
    return issues


def _model_changes(plan: Plan) -> list[Issue]:
    """A Hub model's revision (a branch or tag) that now points at another commit in the cache."""
    section, planned = plan.config.model, plan.model.commit
    if plan.model.source != "hub" or section.hub is None or planned is None:
        return []
    revision = section.revision or DEFAULT_REVISION
    try:
        now = hub.resolve(section.hub, revision).commit
    except hub.NotCached as exc:
        return [
            Issue(
                "model.hub",
                f"{exc.reason} any more (planned: commit {short_hash(planned)})",
            )
        ]
    except ImportError:
        return [Issue("model.hub", "huggingface_hub, which finds Hub models, is not installed")]
    if now == planned:
        return []
    change = f"commit {short_hash(planned)} → {short_hash(now)}"
    return [
        Issue("model.hub", f"{section.hub} revision {revision!r} moved since planning ({change})")
    ]


def _data_changes(plan: Plan) -> list[Issue]:
    issues = []
    for facts in plan.data:
        if is_url(facts.location):
            continue  # remote objects are not re-read here; their listing can be slow or paid
        local = Path(plan.base_dir, facts.location.removeprefix("file://"))
        where = f"data.{facts.split}.path"
        if not local.is_file():
            issues.append(Issue(where, f"data file {local} no longer exists"))
            continue
        now = sha256_file(local)
        if now != facts.fingerprint:
            change = f"sha256 {short_hash(facts.fingerprint)} → {short_hash(now)}"
            issues.append(Issue(where, f"data file {local} changed since planning ({change})"))
    return issues


def _suite_changes(plan: Plan) -> list[Issue]:
    """[[eval.suites]] data files, as _data_changes checks the run's data."""
    issues = []
    for index, facts in enumerate(plan.eval_suites):
        if is_url(facts.location):
            continue
        local, where = Path(facts.location), f"eval.suites[{index}].data"
        if not local.is_file():
            issues.append(Issue(where, f"eval suite file {local} no longer exists"))
        elif (now := sha256_file(local)) != facts.fingerprint:
            change = f"sha256 {short_hash(facts.fingerprint)} → {short_hash(now)}"
            issues.append(
                Issue(where, f"eval suite file {local} changed since planning ({change})")
            )
    return issues


def _config_changes(plan: Plan) -> list[Issue]:
    # A plan may be run where its config is not (copied to another machine): then nothing to compare.
    if not (plan.config_path and plan.config_sha256 and Path(plan.config_path).is_file()):
        return []
    now = sha256_file(plan.config_path)
    if now == plan.config_sha256:
        return []
    change = f"{short_hash(plan.config_sha256)} → {short_hash(now)}"
    message = f"the config changed since planning (sha256 {change}); the plan no longer matches it"
    return [Issue(plan.config_path, message)]
