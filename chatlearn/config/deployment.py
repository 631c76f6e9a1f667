"""The ``deployment`` section: how `chatlearn deploy` / `chatlearn serve` register a config with Prefect.

Not a ChatLearn section (ChatLearn has no scheduler); a config that carries it brings its own schedule and
overlap rule, and the command line's ``--cron``/``--name``/``--on-overlap`` win over it.
"""

from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from pydantic import ConfigDict, Field, ValidationError, field_validator

from chatlearn.config.sections import Section

__all__ = ["DeploymentConfig"]


class DeploymentConfig(Section):
    """Name, schedule and overlap rule of the config's Prefect deployment."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(
        default=None, description="deployment name (default: runtime.exp_name); the run form is chatlearn-train/NAME"
    )
    cron: str | None = Field(
        default=None, description="cron schedule of scheduled runs, e.g. '0 3 * * *' (default: no schedule)"
    )
    timezone: str | None = Field(default=None, description="IANA time zone of the cron schedule (default UTC)")
    on_overlap: Literal["skip", "queue"] = Field(
        default="skip",
        description="a run that finds the previous run of the same deployment still going: 'skip' cancels the "
        "new run, 'queue' waits for the running one to finish (never both writing the same run directory)",
    )
    work_pool: str = Field(
        default="chatlearn", description="process work pool whose worker runs `chatlearn deploy` deployments"
    )
    runs: Literal["separate", "continue"] = Field(
        default="separate",
        description="'separate': each run of the deployment (scheduled, from the UI, triggered) writes its own run "
        "directory, run_dir/<deployment>-<scheduled time, UTC>; 'continue': every run continues the one run in "
        "run_dir (resumes it; once it trained num_episode episodes a run ends at once, complete)",
    )

    @field_validator("cron")
    @classmethod
    def _cron(cls, value: str | None) -> str | None:
        if value is None:
            return value
        # lazy: Prefect's own cron check (croniter rules), through its public schedule model, loads only when a
        # schedule is given
        from prefect.client.schemas.schedules import CronSchedule

        try:
            CronSchedule(cron=value)
        except ValidationError as exc:  # the check's own message, as Prefect words it
            first = exc.errors()[0]
            raise ValueError(str(first.get("ctx", {}).get("error", first["msg"]))) from None
        return value

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                ZoneInfo(value)
            except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # OSError: a name too long for a file
                raise ValueError(f"unknown time zone {value!r} (IANA names, e.g. Europe/Berlin)") from exc
        return value
