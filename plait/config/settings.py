"""Config's checks of the settings beside the layout: the capture, the run's waits and sums, checkpoints and planning."""

from __future__ import annotations

from typing import Any

from plait.errors import ConfigError
from plait.plan.execution import NONFINITE_ACTIONS
from plait.plan.plan import PRECISIONS

__all__ = ["check_leaf_modules", "check_init_fn", "check_running", "check_checkpoints", "check_planning",
           "check_precision"]


# Each check takes the `plait.config.Config` being made (typed Any: plait.config imports this module).


def check_leaf_modules(config: Any) -> None:
    """leaf_modules: names or classes; a class is kept by its name (the config stays JSON)."""
    items = config.leaf_modules
    if isinstance(items, (str, type)) or not isinstance(items, (list, tuple)):
        raise ConfigError(
            f"leaf_modules must be a list of module names or classes, got {items!r}; for example "
            "leaf_modules=['model.layers.0.mlp'] or leaf_modules=[MixtralSparseMoeBlock]"
        )
    names = tuple(x.__name__ if isinstance(x, type) else x for x in items)
    bad = [x for x in names if not isinstance(x, str) or not x]
    if bad:
        raise ConfigError(f"leaf_modules={list(items)!r} holds {bad!r}: give module names (as in "
                          "net.named_modules()), class names or module classes")
    object.__setattr__(config, "leaf_modules", names)


def check_init_fn(config: Any) -> None:
    if config.init_fn is not None and not callable(config.init_fn):
        raise ConfigError(f"init_fn must be a function fn(module) that initialises a module in place, "
                          f"got {config.init_fn!r}")


def check_running(config: Any) -> None:
    """trace_dir, grad_reduction, bucket_cap_mb, clip_grad_norm, timeout_s and seed."""
    if config.trace_dir is not None and not isinstance(config.trace_dir, (str, bytes)) and not hasattr(
        config.trace_dir, "__fspath__"
    ):
        raise ConfigError(f"trace_dir must be a directory path or None, got {config.trace_dir!r}")
    if config.trace_dir is not None:
        object.__setattr__(config, "trace_dir", str(config.trace_dir))
    if config.grad_reduction not in ("mean", "sum"):
        raise ConfigError(f"grad_reduction={config.grad_reduction!r} is not known; choose 'mean' or 'sum'")
    if not (_is_number(config.bucket_cap_mb) and config.bucket_cap_mb > 0):
        raise ConfigError(f"bucket_cap_mb must be a positive number, got {config.bucket_cap_mb!r}")
    clip = config.clip_grad_norm
    if clip is not None and not (_is_number(clip) and clip > 0 and clip != float("inf")):
        raise ConfigError(f"clip_grad_norm must be a positive number (the largest gradient norm) or None, got {clip!r}")
    k = config.accumulate_steps
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"accumulate_steps must be a positive integer (global batches per optimizer step), got {k!r}")
    if not (_is_number(config.timeout_s) and config.timeout_s > 0):
        raise ConfigError(f"timeout_s must be a positive number of seconds, got {config.timeout_s!r}")
    if not isinstance(config.seed, int) or isinstance(config.seed, bool):
        raise ConfigError(f"seed must be an integer (it seeds the shuffle order), got {config.seed!r}")


def check_checkpoints(config: Any) -> None:
    _path(config, "checkpoint_dir", "a directory path")
    every = config.checkpoint_every
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ConfigError(f"checkpoint_every must be a positive number of steps or None (every epoch), got {every!r}")
    keep = config.checkpoint_keep
    if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
        raise ConfigError(f"checkpoint_keep must be a positive integer (2 keeps a fallback), got {keep!r}")
    if config.on_nonfinite not in NONFINITE_ACTIONS:
        raise ConfigError(f"on_nonfinite={config.on_nonfinite!r} is not known; choose one of {list(NONFINITE_ACTIONS)}")


def check_planning(config: Any) -> None:
    if _path(config, "plan", "the path of a plan JSON file") is not None and config.layers_per_stage is not None:
        raise ConfigError(f"plan={config.plan!r} and layers_per_stage={list(config.layers_per_stage)} both give "
                          "the layers of each stage; keep one of them")
    if config.plan is not None and config.split_points is not None:
        raise ConfigError(f"plan={config.plan!r} and split_points={list(config.split_points)} both give the "
                          "layers of each stage; keep one of them")
    limit = config.memory_limit_bytes
    if limit is not None and not (_is_number(limit) and limit > 0):
        raise ConfigError(f"memory_limit_bytes must be a positive number of bytes or None, got {limit!r}")
    if config.accumulate_steps > 1 and config.replan:
        raise ConfigError(f"replan=True moves layers between steps, and accumulate_steps={config.accumulate_steps} "
                          "keeps gradients across them; use one of the two")
    every = config.checkpoint_every
    if config.accumulate_steps > 1 and isinstance(every, int) and every % config.accumulate_steps:
        raise ConfigError(f"checkpoint_every={every} is not a multiple of accumulate_steps={config.accumulate_steps}: "
                          "a checkpoint between them would lose the gradients summed so far; use a multiple")
    if config.replan is not None and not isinstance(config.replan, bool):
        raise ConfigError(f"replan must be True, False or None (as `plait run --replan` says), got {config.replan!r}")
    if config.batch_weight_grads is not None and not isinstance(config.batch_weight_grads, bool):
        raise ConfigError(f"batch_weight_grads must be True or False (or None: the planner's choice), "
                          f"got {config.batch_weight_grads!r}")


def check_precision(config: Any) -> None:
    """precision: one of PRECISIONS; reduce_precision; offload."""
    if not (config.offload is None or config.offload is False or config.offload == "optimizer"):
        raise ConfigError(f"offload={config.offload!r} is not known; choose 'optimizer' (the optimizer state and "
                          "fp32 master weights in host memory), False (never) or None (the planner's choice)")
    if config.offload == "optimizer" and config.zero != 3:
        raise ConfigError(f"offload={config.offload!r} runs with the parameters sharded (FSDP2's CPUOffloadPolicy), "
                          f"but zero={config.zero!r}; set Config(zero=3, offload={config.offload!r})")
    if config.reduce_precision not in ("fp32", "bf16"):
        raise ConfigError(f"reduce_precision={config.reduce_precision!r} is not known; choose 'fp32' (default) or 'bf16'")
    if config.precision not in PRECISIONS:
        raise ConfigError(f"precision={config.precision!r} is not known; choose one of {list(PRECISIONS)}")


def check_compile(config: Any) -> None:
    """compile: False, True (torch.compile's default backend) or a backend's name; not beside
    batch_weight_grads=True."""
    value = config.compile
    if not isinstance(value, bool) and not (isinstance(value, str) and value):
        raise ConfigError(f"compile={value!r} is not known; give True (torch.compile's default backend, inductor), "
                          "False, or a torch.compile backend's name such as 'aot_eager'")
    if value and config.batch_weight_grads is True:
        raise ConfigError(f"compile={value!r} with batch_weight_grads=True: the batched linears keep each "
                          "micro-batch's inputs outside the compiled graph; set batch_weight_grads=False (or None: "
                          "the planner leaves it off when compiling)")
    if value and config.zero == 3:
        raise ConfigError(f"compile={value!r} with zero=3: FSDP2's hooks on a stage's pieces do not trace into one "
                          "compiled graph yet; set zero to 0, 1 or 2 (or None: the planner leaves zero=3 out when "
                          "compiling), or compile=False")


def _path(config: Any, name: str, what: str) -> str | None:
    """Field `name` as a str path (any os.PathLike is accepted), or None."""
    value = getattr(config, name)
    if value is None:
        return None
    if not isinstance(value, str) and not hasattr(value, "__fspath__"):
        raise ConfigError(f"{name} must be {what} or None, got {value!r}")
    object.__setattr__(config, name, str(value))
    return str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
