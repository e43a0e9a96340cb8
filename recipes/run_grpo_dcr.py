#!/usr/bin/env python
"""GRPO with a bit-exact delta refit after every step (run under torchrun).

Single node, CPU, the embedded SmolLM2-135M at TP=3, PP=2 (6 ranks)::

    torchrun --nproc-per-node 6 recipes/run_grpo_dcr.py \
        --config configs/grpo_smollm2_cpu.yaml run.steps=3 dcr.encoding=dcr

or ``bash recipes/launch.sh`` / ``nemo-dcr demo``.  The loop itself is
:func:`nemo_dcr.tools.demo.grpo.train_step`: rollouts from the engine, group-relative
advantages, a policy-gradient step, then ``DeltaRefit.step()`` right after
``optimizer.step()``.  Outputs: ``run.run_dir``/telemetry.jsonl, summary.json, config.yaml
(plots: ``nemo-dcr report RUN_DIR``).
"""

import sys

from nemo_dcr.tools.demo.grpo import main

if __name__ == "__main__":
    sys.exit(main())
