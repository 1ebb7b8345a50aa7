"""What a preflight hands back: its report (problems, warnings, what passed, recommendations,
and the target's tokenizer and config when they loaded), the error a failed one raises,
and `first_line`, an exception said in one line for a finding.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eaglet.errors import PermanentError


class PreflightError(PermanentError, RuntimeError):
    """The config cannot run; the message lists every problem and its fix (`problems`: each
    in one line)."""

    def __init__(self, message: str, problems: list[str] | None = None) -> None:
        super().__init__(message)
        self.problems = list(problems) if problems else [message]


@dataclass
class PreflightReport:
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)
    recommendations: list[str] = field(default_factory=list)  # a better setting, not a fault
    tokenizer: Any = field(default=None, repr=False)  # the target's, when it loaded
    model_config: Any = field(default=None, repr=False)  # its transformers config

    @property
    def ok(self) -> bool:
        return not self.problems

    def render(self) -> str:
        """The report, problems first (the first screen of a refused run's log shows them,
        not a page of checks that passed), then warnings, then what passed."""
        verdict = "ok" if self.ok else f"{len(self.problems)} problem(s)"
        lines = [f"preflight: {verdict}"]
        lines += [f"  problem: {line}" for line in self.problems]
        lines += [f"  warning: {line}" for line in self.warnings]
        lines += [f"  ok:      {line}" for line in self.passed]
        lines += [f"  recommend: {line}" for line in self.recommendations]
        return "\n".join(lines)

    def raise_if_failed(self) -> None:
        if self.problems:
            raise PreflightError(
                "preflight found problems the config already shows (nothing was run):\n  "
                + "\n  ".join(self.problems)
                + "\n(`eaglet doctor CONFIG` runs the same checks)",
                self.problems,
            )


def first_line(exc: BaseException) -> str:
    """`exc` in one line for a finding: its type and the first line of its message."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
