"""The reward functions KubeRL ships (``kuberl.rewards``), by name, so that ``kuberl validate`` and the
operator can refuse ``kuberl.rewards:no_such_reward`` without importing the workload
(``tests/test_rewards.py`` checks that this list is what the module defines)."""

from __future__ import annotations

import difflib

KUBERL_PACKAGE = "kuberl"
IMPORT_PATH_PATTERN = r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$"  # 'package.module:Name': user code a manifest names
KUBERL_REWARDS_MODULE = f"{KUBERL_PACKAGE}.rewards"
KUBERL_REWARDS = ("exact_match", "digit_match", "math", "math_answer", "code")
CODE_REWARD = f"{KUBERL_REWARDS_MODULE}:code"
CODE_WALL_SECONDS = 10.0  # the code reward's sandboxes' wall clock: below spec.reward.timeoutSeconds


def in_kuberl_package(function: str) -> bool:
    """Whether ``function`` ('module:name') names a module of KubeRL's own package."""
    return function.partition(":")[0].split(".")[0] == KUBERL_PACKAGE


def reward_issue(function: str) -> str | None:
    """Why ``function`` ('module:name') cannot be one of KubeRL's rewards, or None: a name its module lacks,
    or a module inside KubeRL's own package that is not its rewards module (``kuberl.reward:math``)."""
    module, _, name = function.partition(":")
    allowed = ", ".join(KUBERL_REWARDS)
    if module == KUBERL_REWARDS_MODULE and name not in KUBERL_REWARDS:
        close = difflib.get_close_matches(name, KUBERL_REWARDS, n=1, cutoff=0.6)
        hint = f"did you mean {module}:{close[0]}? " if close else ""
        return f"{function!r}: {module} has no reward {name!r}; {hint}allowed: {allowed}"
    if in_kuberl_package(function) and module.split(".")[:2] != KUBERL_REWARDS_MODULE.split("."):
        return f"{function!r}: KubeRL's rewards live in {KUBERL_REWARDS_MODULE} ({KUBERL_REWARDS_MODULE}:NAME); " \
               f"allowed: {allowed}"
    return None
