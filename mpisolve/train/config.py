"""What a training run is: its settings, from flags and a TOML file, validated up front.

One declaration (:class:`TrainConfig`'s fields) makes the command-line flags and the
TOML keys: ``--batch-size 64`` or ``batch_size = 64``; flags override the file. Solver
options come from ``--set key=value`` (parsed as the solver's declared type with
:func:`mpisolve.options.parse_option`) or an ``[options]`` table. Every value is checked
here, before any model is built or any training step runs; a bad one raises
:class:`InputError` naming it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import InputError
from ..options import build_options, option_fields, parse_option
from .data import DATASET_FORMS, DEFAULT_IMAGE_SIZE, SYNTHETIC_MIN_SIZE, parse_dataset
from .hetero import PRESETS, factors_for_world, parse_hetero
from .models import MODEL_FORMS, check_model_spec

if TYPE_CHECKING:
    from ..solvers.base import Solver

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

#: Training length when neither --epochs nor --steps is given.
DEFAULT_EPOCHS = 3.0


def _flag(default: Any, help_text: str, kind: type, metavar: str | None = None) -> Any:
    return field(default=default, metadata={"help": help_text, "kind": kind, "metavar": metavar})


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run. Every field but ``options`` is a flag (``--data-size``) and a TOML key."""

    solver: str = _flag("allreduce", "the solver (any name in mpisolve.solver_names())", str, "NAME")
    model: str = _flag("mlp", f"the model: {MODEL_FORMS} (docs/guide/cli.md)", str, "SPEC")
    dataset: str = _flag("digits", f"the data set: {DATASET_FORMS} (docs/guide/cli.md)", str, "SPEC")
    data_size: int = _flag(6000, "examples in the synthetic data set, train and test together", int, "N")
    image_size: int | None = _flag(
        None,
        f"imagefolder: resize each image's shorter side to S, then centre-crop S x S (default {DEFAULT_IMAGE_SIZE})",
        int,
        "S",
    )
    epochs: float | None = _flag(
        None, f"train for this many epochs of global samples (default {DEFAULT_EPOCHS:g})", float, "E"
    )
    steps: int | None = _flag(None, "train for this many applied updates instead of --epochs", int, "N")
    batch_size: int = _flag(32, "micro-batch size of each worker", int, "B")
    lr: float = _flag(0.05, "learning rate of the SGD optimizer", float, "LR")
    momentum: float = _flag(0.9, "momentum of the SGD optimizer", float, "M")
    weight_decay: float = _flag(0.0, "weight decay of the SGD optimizer", float, "WD")
    seed: int = _flag(0, "seed of the model's initialisation and of the data order", int, "S")
    hetero: tuple[float, ...] = _flag(
        (), f"slowdown factor per rank (1,1,2,4) or a preset: {', '.join(PRESETS)}", str, "SPEC"
    )
    hetero_every: float | None = _flag(
        None,
        "move the --hetero factors one rank along every S seconds (a moving straggler: speeds measured once go stale)",
        float,
        "S",
    )
    hetero_drift: bool = _flag(
        False, "with --hetero-every: each factor slides into the next over the period instead of jumping", bool
    )
    device_ms: str | None = _flag(
        None,
        "emulate a device per rank: a micro-batch of n samples takes (hetero factor) x n x MS milliseconds, "
        "the real compute included; 'auto' sets MS to the slowest rank's solo compute per sample times the ranks "
        "sharing each core, times 2",
        str,
        "MS|auto",
    )
    target_accuracy: float | None = _flag(None, "report the training time to reach this test accuracy", float, "A")
    stop_at_target: bool = _flag(False, "stop at the evaluation that reaches --target-accuracy", bool)
    eval_every: float = _flag(0.5, "evaluate the test accuracy every this many epochs (and at the end)", float, "E")
    log_every: int = _flag(10, "write a metrics record every this many updates", int, "N")
    log: str | None = _flag(None, "JSON Lines metrics file (rank 0); the summary goes to LOG.summary.json", str, "PATH")
    tensorboard: str | None = _flag(
        None, "also write the records as TensorBoard scalars in DIR (rank 0; needs the tensorboard package)", str, "DIR"
    )
    checkpoint_dir: str | None = _flag(
        None, "write checkpoints here (at the end, and every --checkpoint-every)", str, "DIR"
    )
    checkpoint_every: int | None = _flag(None, "also checkpoint every this many updates", int, "N")
    resume: bool = _flag(False, "continue from the checkpoint in --checkpoint-dir", bool)
    comm_timeout: float | None = _flag(
        None,
        "watchdog: seconds an MPI operation may wait before the job aborts (default $MPISOLVE_TIMEOUT or 300)",
        float,
        "S",
    )
    #: Solver options (from ``--set key=value`` and the TOML ``[options]`` table), validated.
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise InputError(message)

        check_model_spec(self.model)
        dataset_kind, _ = parse_dataset(self.dataset)
        check(self.image_size is None or self.image_size >= 1, f"--image-size must be >= 1, got {self.image_size}")
        check(
            self.image_size is None or dataset_kind == "imagefolder",
            f"--image-size applies to imagefolder data sets, not {self.dataset!r}",
        )
        check(
            self.data_size >= SYNTHETIC_MIN_SIZE, f"--data-size must be >= {SYNTHETIC_MIN_SIZE}, got {self.data_size}"
        )
        check((self.epochs is None) != (self.steps is None), "give exactly one of --epochs and --steps")
        check(
            self.epochs is None or (math.isfinite(self.epochs) and self.epochs > 0),
            f"--epochs must be > 0, got {self.epochs}",
        )
        check(self.steps is None or self.steps >= 1, f"--steps must be >= 1, got {self.steps}")
        check(self.batch_size >= 1, f"--batch-size must be >= 1, got {self.batch_size}")
        check(math.isfinite(self.lr) and self.lr > 0, f"--lr must be > 0, got {self.lr}")
        check(0 <= self.momentum < 1, f"--momentum must be in [0, 1), got {self.momentum}")
        check(
            math.isfinite(self.weight_decay) and self.weight_decay >= 0,
            f"--weight-decay must be >= 0, got {self.weight_decay}",
        )
        check(self.seed >= 0, f"--seed must be >= 0, got {self.seed}")
        check(
            self.hetero_every is None or (math.isfinite(self.hetero_every) and self.hetero_every > 0),
            f"--hetero-every must be > 0 seconds, got {self.hetero_every}",
        )
        check(self.hetero_every is None or bool(self.hetero), "--hetero-every needs --hetero")
        check(not self.hetero_drift or self.hetero_every is not None, "--hetero-drift needs --hetero-every")
        check(
            self.device_ms is None or self.device_ms == "auto" or _positive_float(self.device_ms),
            f"--device-ms must be 'auto' or a number of milliseconds > 0, got {self.device_ms!r}",
        )
        check(
            self.target_accuracy is None or 0 < self.target_accuracy <= 1,
            f"--target-accuracy must be in (0, 1], got {self.target_accuracy}",
        )
        check(
            math.isfinite(self.eval_every) and self.eval_every > 0, f"--eval-every must be > 0, got {self.eval_every}"
        )
        check(self.log_every >= 1, f"--log-every must be >= 1, got {self.log_every}")
        check(
            self.checkpoint_every is None or self.checkpoint_every >= 1,
            f"--checkpoint-every must be >= 1, got {self.checkpoint_every}",
        )
        check(
            self.checkpoint_every is None or self.checkpoint_dir is not None,
            "--checkpoint-every needs --checkpoint-dir",
        )
        check(not self.stop_at_target or self.target_accuracy is not None, "--stop-at-target needs --target-accuracy")
        check(not self.resume or self.checkpoint_dir is not None, "--resume needs --checkpoint-dir")
        check(
            self.comm_timeout is None or (math.isfinite(self.comm_timeout) and self.comm_timeout > 0),
            f"--comm-timeout must be > 0, got {self.comm_timeout}",
        )

    def workload(self) -> dict[str, Any]:
        """The settings that define the training problem (for logs and summaries)."""
        keys = (
            "model",
            "dataset",
            "data_size",
            "image_size",
            "epochs",
            "steps",
            "batch_size",
            "lr",
            "momentum",
            "weight_decay",
            "seed",
        )
        out = {k: getattr(self, k) for k in keys}
        out["hetero"] = list(self.hetero)
        out["hetero_every"] = self.hetero_every
        out["hetero_drift"] = self.hetero_drift
        out["device_ms"] = self.device_ms
        return out


def _positive_float(text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    return math.isfinite(value) and value > 0


_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig) if f.name != "options"}
#: Settings a compare run takes from the train flags (each solver's log and checkpoints are its own).
_NOT_IN_COMPARE = {"solver", "log", "checkpoint_dir", "checkpoint_every", "resume"}


def add_arguments(parser: argparse.ArgumentParser, *, compare: bool = False) -> None:
    """The flags of ``train`` (or, with ``compare``, of ``compare``), all defaulting to "not given"."""
    parser.add_argument(
        "--config",
        metavar="TOML",
        default=argparse.SUPPRESS,
        help="read settings from this TOML file; flags override it",
    )
    for name, f in _FIELDS.items():
        if (compare and name in _NOT_IN_COMPARE) or name in ("epochs", "steps"):
            continue
        flag = "--" + name.replace("_", "-")
        kind, help_text = f.metadata["kind"], f.metadata["help"]
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(
                flag, type=kind, metavar=f.metadata["metavar"], default=argparse.SUPPRESS, help=help_text
            )
    length = parser.add_mutually_exclusive_group()
    for name in ("epochs", "steps"):
        f = _FIELDS[name]
        length.add_argument(
            "--" + name,
            type=f.metadata["kind"],
            metavar=f.metadata["metavar"],
            default=argparse.SUPPRESS,
            help=f.metadata["help"],
        )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=argparse.SUPPRESS,
        help="a solver option (repeatable)" + ("; SOLVER.KEY=VALUE for one solver only" if compare else ""),
    )


def train_config(args: argparse.Namespace, world_size: int) -> TrainConfig:
    """The validated settings of a ``train`` run at ``world_size`` ranks."""
    values, table, sets = _settings(args, set(_FIELDS))
    solver = values.get("solver", _FIELDS["solver"].default)
    options = _solver_options(solver, _options_for(solver, table, [solver]), sets)
    return _config(values, world_size, solver=solver, options=options)


@dataclass(frozen=True)
class CompareConfig:
    solvers: tuple[str, ...]
    out: str
    runs: tuple[TrainConfig, ...]


def compare_config(args: argparse.Namespace, world_size: int) -> CompareConfig:
    """The validated settings of a ``compare`` run: one :class:`TrainConfig` per solver."""
    from ..solvers import solver_names as registered

    keys = (set(_FIELDS) - _NOT_IN_COMPARE) | {"solvers", "out"}
    values, table, sets = _settings(args, keys)
    names = _solver_list(values.pop("solvers", "all"), registered())
    out = values.pop("out", "runs/compare")
    if not isinstance(out, str):
        raise InputError(f"out must be a path, got {out!r}")
    scoped: dict[str, list[str]] = {name: [] for name in names}
    for item in sets:
        key = item.partition("=")[0]
        if "." in key:
            solver, _, rest = item.partition(".")
            if solver not in registered():
                raise InputError(f"--set {item!r}: unknown solver {solver!r}")
            if solver in scoped:
                scoped[solver].append(rest)
            continue
        for name in _takers(key, names, f"--set {item!r}"):
            scoped[name].append(item)
    runs = tuple(
        _config(
            values,
            world_size,
            solver=name,
            options=_solver_options(name, _options_for(name, table, names), scoped[name]),
        )
        for name in names
    )
    return CompareConfig(names, out, runs)


# ------------------------------------------------------------------ helpers
def _settings(args: argparse.Namespace, keys: set[str]) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """TOML values overridden by the flags given: (settings, options table, --set items)."""
    values: dict[str, Any] = {}
    table: dict[str, Any] = {}
    config = getattr(args, "config", None)
    if config is not None:
        for key, value in _read_toml(config).items():
            name = key.replace("-", "_")
            if name == "options":
                if not isinstance(value, dict):
                    raise InputError(f"{config}: 'options' must be a table")
                table = value
            elif name in keys:
                values[name] = _typed(f"{config}: {key}", name, value)
            else:
                raise InputError(f"{config}: unknown setting {key!r} (known: {', '.join(sorted(keys))}, options)")
    given = {k: v for k, v in vars(args).items() if k in keys}
    if "epochs" in given or "steps" in given:  # a flag's training length replaces the file's
        values.pop("epochs", None)
        values.pop("steps", None)
    values.update(given)
    return values, table, list(getattr(args, "set", []))


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as err:
        raise InputError(f"cannot read config {path}: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise InputError(f"config {path} is not valid TOML: {err}") from None


def _typed(where: str, name: str, value: Any) -> Any:
    """A TOML value checked against the setting's kind."""
    if name == "hetero" and isinstance(value, list):
        return value
    if name == "solvers" and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    kind = _FIELDS[name].metadata["kind"] if name in _FIELDS else str
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if type(value) is not kind:
        raise InputError(f"{where} must be {'a number' if kind is float else kind.__name__}, got {value!r}")
    return value


def _config(values: dict[str, Any], world_size: int, *, solver: str, options: dict[str, Any]) -> TrainConfig:
    settings = {k: v for k, v in values.items() if k not in ("solver", "hetero")}
    if settings.get("epochs") is None and settings.get("steps") is None:
        settings["epochs"] = DEFAULT_EPOCHS
    hetero: tuple[float, ...] = ()
    if "hetero" in values:
        preset, factors = parse_hetero(values["hetero"])
        hetero = factors_for_world(preset, factors, world_size)
    return TrainConfig(solver=solver, options=options, hetero=hetero, **settings)


def _solver_class(name: str) -> type[Solver]:
    from ..solvers.base import solver_class

    return solver_class(name)


def _solver_list(spec: str | list[str], registered: list[str]) -> tuple[str, ...]:
    names = registered if spec == "all" else (spec.split(",") if isinstance(spec, str) else spec)
    names = [n.strip() for n in names]
    for name in names:
        _solver_class(name)  # raises, naming the known solvers
    if len(set(names)) != len(names):
        raise InputError(f"--solvers names a solver twice: {','.join(names)}")
    return tuple(names)


def _options_for(solver: str, table: Mapping[str, Any], selected: Iterable[str]) -> dict[str, Any]:
    """The ``[options]`` entries for ``solver``: plain keys, and its own ``[options.SOLVER]`` table.

    A plain key applies to every selected solver that declares it; it is an error when
    none does. A table for a registered solver that is not selected is ignored.
    """
    from ..solvers import solver_names as registered

    selected = list(selected)
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            if key not in registered():
                raise InputError(f"[options.{key}]: unknown solver {key!r}")
            if key == solver:
                out.update(value)
            continue
        if solver in _takers(key, selected, f"[options] {key!r}"):
            out[key] = value
    return out


def _takers(key: str, names: Sequence[str], where: str) -> list[str]:
    """The solvers among ``names`` that declare option ``key`` (an error when none does)."""
    takers = [n for n in names if key in option_fields(_solver_class(n).Options)]
    if not takers:
        raise InputError(f"{where}: no solver among {', '.join(names)} takes option {key!r}")
    return takers


def _solver_options(solver: str, given: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``given`` (typed values) updated by ``--set`` items, validated by the solver's options class."""
    cls = _solver_class(solver).Options
    options = dict(given)
    for item in sets:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise InputError(f"--set expects KEY=VALUE, got {item!r}")
        options[key.strip()] = parse_option(solver, cls, key.strip(), text.strip())
    build_options(solver, cls, options)  # types and ranges, as the solver will check them
    return options
