"""attnx.train: generic experiment machinery.

`fit(model, train_data=loader(...), config=FitConfig.from_config(config))` trains N seeds of
a Flax model in one vmapped program (optionally data-parallel over devices with shard_map or
pmap), checkpoints and resumes with orbax (refusing a checkpoint made with a different setup,
falling back past damaged ones), logs to JSONL/TensorBoard, and stops on NaN/Inf; its
periodic work is done by the actions of `attnx.train.actions`. `loader` is the one data path
(training streams and evaluation passes). `Report` turns results into report.md +
results.json + PNG plots (`markdown_table`, `plot_curves`).
"""

import os as _os

from attnx import _flax  # noqa: F401  (first: a flax too old for this jax says so)

_os.environ.setdefault("MPLBACKEND", "Agg")  # reports are written headless

# Submodules used as namespaces: train.verdict.compare, train.experiment.run_comparison, ...
from attnx.train import benchmark, evaluators, experiment, sampling, verdict  # noqa: E402, I001
from attnx.train.actions import (  # noqa: E402
    Action,
    CheckFinite,
    Checkpoint,
    Evaluate,
    Log,
    Schedule,
    StepContext,
)
from attnx.train.checkpoint import (  # noqa: E402
    CheckpointDamagedError,
    SavedState,
    list_checkpointed_runs,
    load_checkpoint,
)
from attnx.train.config import (  # noqa: E402
    FitConfig,
    attention_variants,
    base_config,
    check_batch_size,
    check_choice,
    check_choices,
    format_experiments,
    list_experiments,
    load_module,
    split_list,
    validate,
    variant_list,
)
from attnx.train.data import (  # noqa: E402
    PIPELINES,
    Loader,
    array_stream,
    grain_stream,
    loader,
)
from attnx.train.evaluate import METRICS, evaluate  # noqa: E402
from attnx.train.loop import (  # noqa: E402
    CheckpointMismatchError,
    FitResult,
    NonFiniteLossError,
    fit,
    nonfinite_runs,
    run_fingerprint,
)
from attnx.train.losses import (  # noqa: E402
    IGNORE_INDEX,
    LOSSES,
    from_sums,
    get_loss,
    mse,
    reduce_sums,
    softmax_xent,
)
from attnx.train.optim import (  # noqa: E402
    OPTIMIZERS,
    SCHEDULES,
    make_optimizer,
    make_schedule,
    minimize,
    optimizer_config,
)
from attnx.train.parallel import (  # noqa: E402
    PARALLEL_MODES,
    SEQUENCE_AXIS,
    Placement,
    data_mesh,
    is_main_process,
    process_rows,
)
from attnx.train.report import (  # noqa: E402
    Report,
    environment,
    jsonable,
    level_curves,
    level_rows,
    markdown_table,
    mean_std,
    plot_alignments,
    plot_curves,
    plot_learning_curves,
    subplots,
    summary_rows,
)
from attnx.train.step import init_state, make_apply_fn, make_step, seed_step  # noqa: E402

__all__ = [
    "benchmark", "evaluators", "experiment", "sampling", "verdict",
    "IGNORE_INDEX", "LOSSES", "METRICS", "OPTIMIZERS", "PARALLEL_MODES", "PIPELINES", "SCHEDULES",
    "SEQUENCE_AXIS",
    "Action", "CheckFinite", "Checkpoint", "CheckpointDamagedError", "CheckpointMismatchError",
    "Evaluate", "FitConfig", "FitResult", "Loader", "Log", "NonFiniteLossError", "Placement",
    "Report", "SavedState", "Schedule", "StepContext", "array_stream", "base_config",
    "check_batch_size",
    "check_choice", "data_mesh", "environment", "evaluate", "fit", "format_experiments",
    "from_sums", "get_loss", "grain_stream", "init_state", "is_main_process", "jsonable",
    "list_checkpointed_runs", "list_experiments", "load_checkpoint",
    "load_module", "loader", "make_apply_fn", "make_optimizer", "make_schedule", "make_step",
    "attention_variants", "check_choices", "minimize", "variant_list",
    "markdown_table", "mean_std", "mse", "nonfinite_runs", "optimizer_config", "plot_curves",
    "plot_learning_curves", "process_rows", "reduce_sums", "run_fingerprint", "seed_step",
    "softmax_xent", "split_list", "subplots", "summary_rows", "validate",
    "level_curves", "level_rows", "plot_alignments",
]
