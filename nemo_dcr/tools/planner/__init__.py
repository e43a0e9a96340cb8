"""``nemo-dcr plan``: the cost of a delta refit per trainer and engine rank, from a model config and
two layouts, before the GPUs exist (docs/plan.md).

Every rank's work is derived from the layout tables the remap uses (:mod:`nemo_dcr.tools.planner.work`);
time comes from measured CPU kernel figures, named GPU assumptions and measured codec points
(:mod:`nemo_dcr.tools.planner.figures`), and a link model per tier (:mod:`nemo_dcr.tools.planner.links`)::

    from nemo_dcr.layout import model_dims
    from nemo_dcr.tools.planner import make_plan, preset_for, default_figures
    plan = make_plan("kimi-k2", model_dims("kimi-k2"), preset_for("kimi-k2"), default_figures(density=0.03))
    plan.refit_seconds, plan.path, plan.trainers[0].row()
"""

from nemo_dcr.tools.planner.cost import Figures
from nemo_dcr.tools.planner.figures import default_figures
from nemo_dcr.tools.planner.inputs import EngineDeployment, Hardware, Links, PlanSetup
from nemo_dcr.tools.planner.estimate import Plan, make_plan, rank_shares, what_it_takes
from nemo_dcr.tools.planner.presets import PRESETS, preset_for

__all__ = ["EngineDeployment", "Figures", "Hardware", "Links", "PRESETS", "Plan", "PlanSetup", "default_figures",
           "make_plan", "preset_for", "rank_shares", "what_it_takes"]
