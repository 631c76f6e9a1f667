"""A user's module class for tests/test_train_flow.py, in a module Ray workers can import (`tests.hooked_reward`;
pytest imports test files under their bare names, which workers cannot)."""

import os

from chatlearn.models.hf.reward import RuleReward


class HookedReward(RuleReward):
    """A rule reward whose ChatLearn episode hooks append to run_dir/hooks.log (they run in its worker)."""

    def before_episode(self):
        self._note("before")

    def after_episode(self):
        self._note("after")

    def _note(self, what):
        with open(os.path.join(self.runtime_args.run_dir, "hooks.log"), "a") as f:
            f.write(what + "\n")
