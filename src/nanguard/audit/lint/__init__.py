"""Static analysis of training code for the classic numerical mistakes (rule codes NG001..)."""

from nanguard.audit.lint.engine import LintFinding, lint_paths, lint_source
from nanguard.audit.lint.rules import RULES

__all__ = ["RULES", "LintFinding", "lint_paths", "lint_source"]
