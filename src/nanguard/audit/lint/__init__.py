"""Static analysis of training code for the classic numerical mistakes (rule codes NG001..)."""

from nanguard.audit.lint.check import lint_paths, lint_source
from nanguard.audit.lint.engine import LintFinding
from nanguard.audit.lint.rules import RULES

__all__ = ["RULES", "LintFinding", "lint_paths", "lint_source"]
