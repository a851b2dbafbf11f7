"""Memory planning and the strategy decision guide behind ``rtp plan``.

No torch and no Ray at import time: plain dataclasses and arithmetic.

>>> from raytrain_platform.plan import Layout, estimate_memory, make_plan, preset_shape
>>> gpt2 = preset_shape("gpt2")
>>> estimate_memory(model=gpt2, layout=Layout(micro_batch=4)).params == 4 * gpt2.num_params
True
>>> make_plan(model=gpt2, device_memory=24 * 10**9, global_batch=512).recommended.strategy
'accum'
"""

from raytrain_platform.plan.guide import Option, Plan, PlanRequest, make_plan
from raytrain_platform.plan.memory import Layout, MemoryEstimate, estimate_memory
from raytrain_platform.plan.shapes import ModelShape, generic_shape, gpt_shape, mlp_shape, preset_shape

__all__ = ["estimate_memory", "make_plan", "Layout", "MemoryEstimate", "Plan", "PlanRequest", "Option",
           "ModelShape", "gpt_shape", "mlp_shape", "generic_shape", "preset_shape"]
