"""The policy stage: observe / raise / skip / rollback as objects that decide, never act."""

from nanguard.policy.stage import Decision, Policy, make_policy, wants_to_act

__all__ = ["Decision", "Policy", "make_policy", "wants_to_act"]
