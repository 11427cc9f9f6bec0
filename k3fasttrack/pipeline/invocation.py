"""The invocation of ``k3ft validate``, recorded in the run folder so that ``--resume`` runs
exactly what was asked (every option, the profile as given); secret values are never written
anywhere, only the names of the secret options that were given."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from pathlib import Path

from k3fasttrack.errors import UsageError
from k3fasttrack.models.base import Record

STATE_FILE = "state.json"
SECRET_OPTIONS: dict[str, tuple[str, str]] = {
    "gpqa_password": ("--gpqa-password", "K3FT_GPQA_PASSWORD"),
}
"""Option name -> (flag, environment variable) for options whose values are secrets."""
REDACTED = "<redacted>"


class Invocation(Record):
    """What ``k3ft validate`` was asked to do (``state.json`` of the run folder)."""

    profile: str
    """The profile as given: an embedded profile's name or the YAML path as typed."""
    profile_path: str | None = None
    """Absolute path of the YAML file when the profile is one (what a resume loads)."""
    tp: int
    options: dict[str, str]
    """Tier options (``--repo``, ``--base``, ``--gpqa-zip``, ...), paths made absolute,
    secrets left out."""
    secrets: tuple[str, ...] = ()
    """Names of the secret options that were given (their values are never recorded)."""
    key: str | None = None
    sign: bool = True
    command: tuple[str, ...]
    """The command line, secret values redacted."""

    @property
    def profile_ref(self) -> str:
        """What ``load_profile`` reads: the resolved YAML path, else the name."""
        return self.profile_path or self.profile


def redact_argv(argv: Sequence[str]) -> tuple[str, ...]:
    """``argv`` with the value of every secret option replaced by ``<redacted>``."""
    flags = {flag for flag, _ in SECRET_OPTIONS.values()}
    out: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            out.append(REDACTED)
            hide_next = False
        elif arg in flags:
            out.append(arg)
            hide_next = True
        elif arg.split("=", 1)[0] in flags and "=" in arg:
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        else:
            out.append(arg)
    return tuple(out)


def profile_path(given: str) -> str | None:
    """The absolute path of a profile given as an existing file, else None (a name)."""
    path = Path(given)
    return str(path.resolve()) if path.is_file() else None


def split_options(options: Mapping[str, object]) -> tuple[dict[str, str], dict[str, str]]:
    """(recordable options with paths made absolute, secret options) of the given ones."""
    plain: dict[str, str] = {}
    secret: dict[str, str] = {}
    for name, value in options.items():
        if value is None:
            continue
        if name in SECRET_OPTIONS:
            secret[name] = str(value)
        else:
            plain[name] = str(value.resolve()) if isinstance(value, Path) else str(value)
    return plain, secret


def read_state(out: Path) -> dict[str, object]:
    """The run folder's state (profile, tp, invocation); a usage error when there is none."""
    try:
        data = json.loads((out / STATE_FILE).read_text())
    except FileNotFoundError:
        raise UsageError(f"--resume: {out} holds no k3ft run to resume") from None
    except (OSError, ValueError) as exc:
        raise UsageError(f"--resume: {out / STATE_FILE} is unreadable ({exc})") from None
    if not isinstance(data, dict):
        raise UsageError(f"--resume: {out / STATE_FILE} is not a k3ft run state")
    return data


def recorded_invocation(out: Path) -> Invocation | None:
    """The invocation recorded when the run started (None for runs that predate recording)."""
    raw = read_state(out).get("invocation")
    if raw is None:
        return None
    try:
        return Invocation.model_validate(raw)
    except ValueError as exc:
        raise UsageError(f"--resume: {out / STATE_FILE}: unreadable invocation ({exc})") from None


def refuse_finished_signed(out: Path) -> None:
    """A finished, signed run is evidence: it is never run again nor overwritten."""
    bundle = out / "bundle"
    if (bundle / "manifest.json").exists() or (out / "bundle.tar.gz").exists():
        outcome = "unknown"
        try:
            outcome = str(json.loads((bundle / "verdict.json").read_text())["outcome"])
        except (OSError, ValueError, KeyError, TypeError):
            pass
        raise UsageError(f"--resume: {out} is a finished, signed run (verdict {outcome}); it is "
                         "never overwritten: start a new run with another --out")


def _conflicts(recorded: Invocation, given: Invocation, given_tp: int | None) -> list[str]:
    """Options given again on resume that differ from the run's."""
    out: list[str] = []
    if given.profile and given.profile_ref != recorded.profile_ref:
        out.append(f"--profile {given.profile} (the run's: {recorded.profile})")
    if given_tp is not None and given_tp != recorded.tp:
        out.append(f"--tp {given_tp} (the run's: {recorded.tp})")
    for name, value in given.options.items():
        if recorded.options.get(name) != value:
            flag = "--" + name.replace("_", "-")
            out.append(f"{flag} {value} (the run's: {recorded.options.get(name, 'not given')})")
    return out


def resume_invocation(recorded: Invocation, given: Invocation, given_tp: int | None,
                      given_sign: bool | None, secrets: Mapping[str, str]) -> Invocation:
    """The recorded invocation, refusing options given again with other values and secret
    options that the run had but that are not given again."""
    conflicts = _conflicts(recorded, given, given_tp)
    if conflicts:
        raise UsageError("--resume: a run keeps the options it started with; differs: "
                         + "; ".join(conflicts), hint="start a new run with another --out")
    missing = [SECRET_OPTIONS[n] for n in recorded.secrets if n not in secrets]
    if missing:
        asks = " or ".join(f"{flag} again or set {env}" for flag, env in missing)
        raise UsageError(f"--resume: the run was given a secret that is never recorded: "
                         f"give {asks}")
    updates: dict[str, object] = {}
    if given.key is not None:
        updates["key"] = given.key
    if given_sign is not None:
        updates["sign"] = given_sign
    return recorded.model_copy(update=updates)


def resume_hint(out: Path, invocation: Invocation) -> str:
    """The command that continues the run (everything else is recorded in the run folder)."""
    hint = f"k3ft validate --out {shlex.quote(str(out))} --resume"
    for name in invocation.secrets:
        flag, env = SECRET_OPTIONS[name]
        hint += f" (give {flag} again or set {env})"
    return hint
