"""The demo RL recipe (GRPO on the embedded model): task, rollouts, trainer step, the torchrun worker.\n\nNot part of the library core: it shows the refit path in a real loop."""
