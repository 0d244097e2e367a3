"""When runs stop, evaluate, log and checkpoint; how busy, comm and idle are split."""

import io

from mpisolve.train.accounting import split_time
from mpisolve.train.display import Display
from mpisolve.train.schedule import Progress, Schedule


def schedule(**kw):
    settings = dict(
        train_size=100, epochs=2.0, steps=None, eval_every=0.5, log_every=3, checkpoint_every=4, checkpoints=True
    )
    return Schedule(**{**settings, **kw})


def test_epochs_count_global_samples_and_events_fire_on_crossings():
    s = schedule()
    due = s.due(Progress(2, 40), Progress(3, 60))  # crosses 0.5 epochs and 3 updates
    assert (due.stop, due.evaluate, due.log, due.checkpoint) == (False, True, True, False)
    due = s.due(Progress(3, 60), Progress(4, 80))
    assert (due.stop, due.evaluate, due.log, due.checkpoint) == (False, False, False, True)
    due = s.due(Progress(9, 190), Progress(10, 200))  # 2 epochs: stop, and everything with it
    assert (due.stop, due.evaluate, due.log, due.checkpoint) == (True, True, True, True)
    assert s.epoch(Progress(10, 250)) == 2.5


def test_steps_stop_and_no_checkpoints_without_a_directory():
    s = schedule(epochs=None, steps=5, checkpoints=False)
    assert not s.due(Progress(3, 10), Progress(4, 20)).stop
    due = s.due(Progress(4, 20), Progress(5, 30))
    assert due.stop and not due.checkpoint
    assert s.fraction(Progress(4, 0)) == 0.8


def test_busy_comm_idle_split():
    busy, comm, idle = split_time([10.0, 10.0, 8.0], [6.0, 2.0, 4.0])
    assert busy == [0.4, 0.8, 0.5]
    assert comm == [0.2, 0.2, 0.25]  # the least any rank waited: 2 s
    assert idle == [0.4, 0.0, 0.25]


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal_and_lines_otherwise():
    tty, plain = Terminal(), io.StringIO()
    for stream in (tty, plain):
        display = Display("allreduce", stream=stream)
        display.update(0.5, {"loss": 0.25, "test_acc": None}, important=True)
        display.update(0.6, {"loss": 0.2})  # a plain line only every 10 s
        display.close()
    assert tty.getvalue().startswith("\rallreduce [" + "#" * 15 + "." * 15 + "]  50% loss 0.25")
    assert plain.getvalue() == "allreduce: 50% loss 0.25\n"
