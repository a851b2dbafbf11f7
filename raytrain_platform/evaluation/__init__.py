"""`rtp eval`: score a run, checkpoint or export on lm-evaluation-harness tasks.

    rtp eval runs/ft --tasks docmc --include eval_tasks/            # lm_eval's HF model on an export
    rtp eval runs/ft --tasks docmc --include eval_tasks/ --base-url http://127.0.0.1:8000 --served-model ft

Tasks are lm_eval's own YAML files (a local JSONL through ``dataset_path: json``); the
model is a Hugging Face folder (a run is exported to one first, in a temporary folder),
read by lm_eval's ``hf`` model class, or the same model behind ``rtp serve`` through its
``local-completions`` model (echo + logprobs). Scores go to the run directory's
``eval/`` folder as JSON, and to the run's MLflow run and TensorBoard events when its
``run.tracking`` names them. ``run.eval_tasks`` runs the same at the end of ``rtp train``.

Layer: above ``export`` (it exports runs) and ``tracking``, below ``launch`` (which calls
it at the end of training). lm_eval is an optional extra (``pip install
'raytrain_platform[eval]'``), imported when an evaluation runs.
"""

from raytrain_platform.evaluation.harness import EvalSpec, evaluate, evaluate_path
from raytrain_platform.evaluation.tasks import check_tasks, require_lm_eval
from raytrain_platform.evaluation.target import EvalTarget, prepared_target

__all__ = ["EvalSpec", "EvalTarget", "check_tasks", "evaluate", "evaluate_path", "prepared_target",
           "require_lm_eval"]
