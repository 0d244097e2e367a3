"""Settings from flags and TOML: merging, types, ranges, solver options."""

import pytest

from mpisolve.cli import OneLineParser
from mpisolve.errors import InputError, OptionError
from mpisolve.train import compare as compare_command
from mpisolve.train import config as settings
from mpisolve.train.hetero import PRESETS


def parse(argv, compare=False):
    parser = OneLineParser(prog="t")
    (compare_command if compare else settings).add_arguments(parser)
    return parser.parse_args(argv)


def toml(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_defaults_and_flags():
    cfg = settings.train_config(parse(["--lr", "0.1", "--batch-size", "8", "--model", "cnn"]), world_size=2)
    assert (cfg.lr, cfg.batch_size, cfg.model, cfg.solver) == (0.1, 8, "cnn", "allreduce")
    assert cfg.epochs == settings.DEFAULT_EPOCHS and cfg.steps is None and cfg.hetero == ()


def test_flags_override_the_config_file(tmp_path):
    path = toml(tmp_path, "lr = 0.2\nbatch-size = 16\nepochs = 2\nhetero = [1, 3]\n[options]\nbucket_mb = 4\n")
    cfg = settings.train_config(parse(["--config", path, "--lr", "0.3", "--steps", "7", "--set", "bucket_mb=2"]), 2)
    assert cfg.lr == 0.3 and cfg.batch_size == 16  # flag over file, file over default
    assert cfg.steps == 7 and cfg.epochs is None  # a flag's length replaces the file's
    assert cfg.hetero == (1.0, 3.0) and cfg.options == {"bucket_mb": 2.0}
    cfg = settings.train_config(parse(["--config", path]), 2)
    assert cfg.epochs == 2.0 and cfg.options == {"bucket_mb": 4}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--lr", "-1"], "--lr must be > 0"),
        (["--momentum", "1"], "--momentum must be in [0, 1)"),
        (["--model", "vgg"], "unknown model 'vgg'"),
        (["--dataset", "mnist"], "unknown dataset 'mnist'"),
        (["--steps", "0"], "--steps must be >= 1"),
        (["--target-accuracy", "1.5"], "--target-accuracy must be in (0, 1]"),
        (["--resume"], "--resume needs --checkpoint-dir"),
        (["--checkpoint-every", "5"], "--checkpoint-every needs --checkpoint-dir"),
        (["--stop-at-target"], "--stop-at-target needs --target-accuracy"),
        (["--hetero", "1,0.5"], "factors must be finite and >= 1"),
        (["--hetero", "fast"], "neither a preset"),
        (["--hetero", "1,2,3"], "3 factors for 2 ranks"),
        (["--solver", "nope"], "unknown solver 'nope'"),
        (["--set", "bucket_mb"], "--set expects KEY=VALUE"),
        (["--set", "bucket_mb=big"], "option 'bucket_mb' of solver 'allreduce' must be float"),
        (["--set", "bucket_mb=0"], "bucket_mb must be > 0"),
        (["--set", "nope=1"], "does not take option 'nope'"),
        (["--batch-size", "0"], "--batch-size must be >= 1, got 0"),
        (["--batch-size", "-4"], "--batch-size must be >= 1, got -4"),
        (["--data-size", "0"], "--data-size must be >="),
        (["--epochs", "0"], "--epochs must be > 0, got 0.0"),
        (["--epochs", "-1"], "--epochs must be > 0, got -1.0"),
        (["--log-every", "0"], "--log-every must be >= 1, got 0"),
        (["--checkpoint-dir", "x", "--checkpoint-every", "0"], "--checkpoint-every must be >= 1, got 0"),
        (["--comm-timeout", "0"], "--comm-timeout must be > 0, got 0.0"),
        (["--device-ms", "fast"], "--device-ms must be 'auto' or a number of milliseconds > 0, got 'fast'"),
        (["--device-ms", "0"], "--device-ms must be 'auto' or a number of milliseconds > 0, got '0'"),
        (["--device-ms", "nan"], "--device-ms must be 'auto'"),
        (["--comm-timeout", "-5"], "--comm-timeout must be > 0, got -5.0"),
        (["--hetero", "2"], "1 factors for 2 ranks"),
        (["--hetero-every", "5"], "--hetero-every needs --hetero"),
        (["--hetero", "1,4", "--hetero-drift"], "--hetero-drift needs --hetero-every"),
        (["--hetero", "1,4", "--hetero-every", "0"], "--hetero-every must be > 0 seconds, got 0.0"),
        (["--hetero", "1,4", "--hetero-every", "inf"], "--hetero-every must be > 0 seconds, got inf"),
        (
            ["--set", "nonfinite=maybe"],
            "option 'nonfinite' of solver 'allreduce' must be one of 'raise', 'skip', 'ignore'",
        ),
        (["--solver", "async-sgd", "--set", "tau=0"], "tau must be >= 1, got 0"),
        (["--solver", "easgd", "--set", "bucket_mb=4"], "solver 'easgd' does not take option 'bucket_mb'"),
    ],
)
def test_bad_values_name_the_problem(argv, message):
    with pytest.raises(InputError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        settings.train_config(parse(argv), world_size=2)


def test_bad_config_files(tmp_path):
    with pytest.raises(InputError, match="cannot read config"):
        settings.train_config(parse(["--config", str(tmp_path / "missing.toml")]), 2)
    with pytest.raises(InputError, match="not valid TOML"):
        settings.train_config(parse(["--config", toml(tmp_path, "lr = = 1")]), 2)
    with pytest.raises(InputError, match="unknown setting 'learning_rate'"):
        settings.train_config(parse(["--config", toml(tmp_path, "learning_rate = 1.0")]), 2)
    with pytest.raises(InputError, match="batch_size must be int, got 1.5"):
        settings.train_config(parse(["--config", toml(tmp_path, "batch_size = 1.5")]), 2)
    with pytest.raises(OptionError, match="bucket_mb must be > 0"):
        settings.train_config(parse(["--config", toml(tmp_path, "[options]\nbucket_mb = -1")]), 2)
    with pytest.raises(InputError, match="--batch-size must be >= 1, got 0"):
        settings.train_config(parse(["--config", toml(tmp_path, "batch_size = 0")]), 2)
    with pytest.raises(InputError, match="--hetero gives 3 factors for 2 ranks"):
        settings.train_config(parse(["--config", toml(tmp_path, "hetero = [1, 2, 3]")]), 2)
    with pytest.raises(InputError, match="unknown solver 'sgd'"):
        settings.train_config(parse(["--config", toml(tmp_path, 'solver = "sgd"')]), 2)
    with pytest.raises(InputError, match="no solver among allreduce takes option 'tau'"):
        settings.train_config(parse(["--config", toml(tmp_path, "[options]\ntau = 2")]), 2)


def test_presets_repeat_over_the_ranks():
    cfg = settings.train_config(parse(["--hetero", "straggler"]), world_size=8)
    assert cfg.hetero == PRESETS["straggler"] * 2
    assert all(len(f) == 4 and min(f) == 1 and max(f) > 1 for f in PRESETS.values()) and len(PRESETS) == 3


def test_compare_options_scoped_and_shared(tmp_path):
    plan = settings.compare_config(parse(["--solvers", "allreduce", "--set", "allreduce.bucket_mb=3"], compare=True), 2)
    assert plan.solvers == ("allreduce",) and plan.runs[0].options == {"bucket_mb": 3.0}
    plan = settings.compare_config(parse(["--set", "bucket_mb=5", "--out", "x"], compare=True), 2)
    assert plan.out == "x" and all(r.options == {"bucket_mb": 5.0} for r in plan.runs if r.solver == "allreduce")
    with pytest.raises(InputError, match="no solver among allreduce takes option 'nope'"):
        settings.compare_config(parse(["--solvers", "allreduce", "--set", "nope=1"], compare=True), 2)
    with pytest.raises(InputError, match="names a solver twice"):
        settings.compare_config(parse(["--solvers", "allreduce,allreduce"], compare=True), 2)
    with pytest.raises(InputError, match="unknown setting 'log'"):
        settings.compare_config(parse(["--config", toml(tmp_path, 'log = "x.jsonl"')], compare=True), 2)


def test_compare_all_means_every_registered_solver_and_tables_are_scoped(tmp_path):
    import mpisolve

    path = toml(tmp_path, 'solvers = "all"\nout = "o"\n[options.allreduce]\nbucket_mb = 7\n')
    plan = settings.compare_config(parse(["--config", path], compare=True), 2)
    assert plan.solvers == tuple(mpisolve.solver_names())
    assert next(r for r in plan.runs if r.solver == "allreduce").options == {"bucket_mb": 7}
    with pytest.raises(InputError, match=r"\[options.nope\]: unknown solver"):
        settings.compare_config(parse(["--config", toml(tmp_path, "[options.nope]\nx = 1\n")], compare=True), 2)
