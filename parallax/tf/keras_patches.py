"""Every change parallax makes to Keras (monkeypatches), for the Keras versions in
`KERAS_VERSIONS` (TF backend), each installed once per process by the `ParallaxStrategy`
(when it is made, or when it plans) and marked so that a second install does nothing. What
parallax only reads of Keras is `keras_support`.

Around Keras' `fit`, `evaluate` and `predict` (`install`):

- A model built outside `strategy.scope()` has no `ParallaxVariable`s, and its `fit` outside
  the scope runs under TF's default strategy: in a job of several workers each would train
  its own copy on all the data, silently. In a job (several workers, or started by
  `parallax run`) its `fit` is refused (ConfigError naming the fix); its `evaluate` and
  `predict` (right, if not distributed: a serving copy's, a loaded file's) and, in one
  process started by hand, its `fit` (plain Keras beside the strategy) get a warning. A
  model built inside but compiled outside (its optimizer made outside) is refused by `fit`
  before TF's "Mixing different tf.distribute.Strategy objects".
- `compile(jit_compile=True)`: XLA has no kernel for the ops parallax puts in a step (row
  pulls and pushes, reads of variables before the plan), so Keras' functions are made with
  `jit_compile=False` and one warning (`_without_xla`), as Keras itself does for a model
  XLA cannot compile. (A custom loop's own `tf.function(jit_compile=True)` is refused by the
  strategy when traced, naming the option.)
- `evaluate` or `predict` before the first training step traces functions that read the
  variables locally; the plan then moves tables to the servers. The plan drops those cached
  functions (`forget_functions`), so Keras traces them again on their next call.
- `evaluate` and `predict` (and `fit`'s validation) count every row: their datasets are split
  with `cover_for_worker` (`covering_rows()` is true while Keras makes their iterator; its
  training iterator is the one given `class_weight`), and `predict` gathers every worker's
  rows (a collective: every worker calls it, as under MWMS). `predict_on_batch` predicts
  this worker's batch alone, with a function of its own (`predicting_on_batch()`).
- Keras' logs are averaged over the workers in each step, except inside Keras' multi-step loop
  (`steps_per_execution` > 1), where a collective would run again before the last one ended
  (Horovod refuses a second all-reduce of the same name in flight): there they are averaged
  once per execution, outside the loop (`average_outside`).
- `fit`'s training data, split by `datasets.shard_for_worker`, loses a last, partial global
  batch (every worker must run the same steps). Keras counted it, and would warn on every
  worker, every epoch, that "Your input ran out of data": the training iterator counts one
  batch less instead (arrays say when; a dataset of known length is learned from at the
  end of its first epoch, where that one warning is dropped). Keras' other such warnings
  (a `steps_per_epoch` the data cannot feed) stay.
- A resumed `fit` starts at the epoch Keras' `BackupAndRestore` read from each worker's own
  backup (and, for a batch-level backup, after the batches of it that backup had trained:
  `parallax.tf.state.batch_resume`; the training iterator skips them, and each epoch's
  backups record that epoch, `_backups_epoch`), and the workers'
  backups need not agree: one killed while saving (or whose save of
  the tables on the servers failed) keeps the epoch before, while another had already written
  the next. The workers would then run different numbers of steps and the job fail at the
  first collective one of them no longer joins. Every worker's `fit` starts at the chief's
  epoch and batch instead (`_chiefs_epoch`, a broadcast once its callbacks began training), as every
  worker resumes the chief's tables and the chief's dense variables (broadcast at the first
  step) too. One `BackupAndRestore` directory on several workers is refused there
  (`_refuse_shared_backups`): each would delete it at the end of `fit`, one while another
  still saved.
- An elastic job (`parallax run --host-discovery-script`) stops for a new worker count at the
  end of an epoch whose callbacks saved a checkpoint (`_rescale_point`,
  `parallax.tf.state.rescale`), or with a batch-level `BackupAndRestore`, at the end of a
  batch it backed up (`_rescale_at_backups`), before `on_train_end` (where `BackupAndRestore`
  would delete its backup).

Beside them (`route_keras_take`, `check_sparse_values_only`, `make_weight_saves_atomic`,
`attach_to_keras_optimizers`):

- Keras' `Embedding` (and any layer calling `keras.ops.take(variable, ids, axis=0)`) reads the
  whole variable, then gathers. For a table on the servers that would pull every row, so
  `route_keras_take()` wraps the TensorFlow backend's `take` once: when `x` is a Keras
  variable whose storage is a remote `ParallaxVariable` and `axis == 0`, the lookup becomes
  the variable's `sparse_read`. Everything else goes to Keras' own `take` unchanged.
- `LossScaleOptimizer.check_finite` densifies every `IndexedSlices` gradient to test it: a
  table's whole size on every step, and impossible for a keyed table (a DynamicEmbedding's),
  whose ids are keys beyond any dense shape. `check_sparse_values_only()` has it test the
  slices' values (the same answer: the rows a dense gradient adds are zeros).
- `BackupAndRestore` writes its record of where a backup was taken ({"epoch", "batch"}) in
  place: `make_backup_records_atomic()` writes it whole, then renames it into place. With
  PARALLAX_HELD_BACKUPS it also saves and loads the held backups of a `ParallaxStrategy`
  model (`parallax.tf.state.held_backups`).
- Keras writes `save_weights` files in place: a save that fails half-way (the servers refuse
  their checkpoint, a full disk) leaves `BackupAndRestore`'s only backup truncated, and no
  restart can resume. `make_weight_saves_atomic()` has local files written under a temporary
  name beside them and renamed over the old file only once complete.
- Every Keras optimizer made in a `ParallaxStrategy`'s scope gets the strategy's
  `resume.ServerTables` as its attribute `parallax_server_tables` (`parallax.tf.state.resume`
  says why), and Keras' and TensorFlow's loads name the file they load (`resume.LOADING`),
  so a warning about a file's tables can say which file.
"""
from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import socket
import threading
import warnings
import weakref

import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util_v2

from parallax.env import RUN_ID_ENV
from parallax.errors import ConfigError
from parallax.tf.graph.variables import ParallaxVariable, raised_in_op, remote_of
from parallax.tf.keras_support import refuse_horovod_optimizer
from parallax.tf.state import batch_resume, held_backups, rescale, resume

log = logging.getLogger("parallax")
# The Keras versions these patches are written for and tested on (the minor releases pinned
# by requirements/base.txt and latest.txt; setup.cfg's `tf` extra allows the range around them).
KERAS_VERSIONS = ("3.15",)
_MARK = "_parallax_keras_calls"
_ROUTED_MARK = "_parallax_routed"
_ATOMIC_MARK = "_parallax_atomic"
_TABLES_MARK = "_parallax_tables_attached"
_WEIGHTS_SUFFIX = ".weights.h5"  # what Keras 3 requires of save_weights paths
_job: list = [None]                                   # weakref to the latest ParallaxExtended
_installed: weakref.WeakSet = weakref.WeakSet()    # every ParallaxExtended made
_unplanned = weakref.WeakKeyDictionary()              # model -> weakref(extended)
_averaged_outside = weakref.WeakKeyDictionary()       # model -> weakref(extended)
_state = threading.local()
_BATCH_FUNCTION = "_parallax_batch_predict_function"  # predict_on_batch's own
_warned: set[tuple[int, str]] = set()


def install(extended) -> None:
    """Remember `extended` as this process's job and patch Keras once."""
    _job[0] = weakref.ref(extended)
    _installed.add(extended)
    import keras
    from keras.src.backend.tensorflow import trainer

    if getattr(keras.Model.fit, _MARK, False):
        return
    for method in ("fit", "evaluate", "predict"):
        _patch(keras.Model, method, _guarded(method, getattr(keras.Model, method)))
    _patch(keras.Model, "predict_on_batch", _on_batch(keras.Model.predict_on_batch))
    _patch(keras.Model, "load_weights", _deferring_optimizer_state(keras.Model.load_weights))
    _patch(keras.Model, "_symbolic_build",  # noqa: SLF001 - Keras' method: fit builds there
           _loading_deferred_state(keras.Model._symbolic_build))  # noqa: SLF001 - (the same)
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
    _patch(BaseOptimizer, "load_own_variables",
           _kept_until_built(BaseOptimizer.load_own_variables))
    for owner in (BaseOptimizer, LossScaleOptimizer):
        _patch(owner, "apply", _dropping_deferred_state(owner.apply))
    for kind in ("train", "test", "predict"):
        name = f"make_{kind}_function"
        _patch(keras.Model, name, _making(kind, getattr(keras.Model, name)))
    trainer.TFEpochIterator = _covering_iterator(trainer.TFEpochIterator)
    from keras.src.callbacks.callback_list import CallbackList
    _patch(CallbackList, "on_train_begin", _chiefs_epoch(CallbackList.on_train_begin))
    _patch(CallbackList, "on_epoch_begin", _backups_epoch(CallbackList.on_epoch_begin))
    _patch(CallbackList, "on_epoch_end", _rescale_point(CallbackList.on_epoch_end))
    _patch(CallbackList, "on_train_batch_end",
           _rescale_at_backups(CallbackList.on_train_batch_end))


def _patch(owner, name: str, replacement) -> None:
    setattr(replacement, _MARK, True)
    setattr(owner, name, replacement)


# ---- models built (or compiled) outside the scope ----------------------------------------

def _extended_of(model):
    """The ParallaxExtended `model` runs under (its own strategy, else the current one)."""
    extended = getattr(model.distribute_strategy, "extended", None)
    return extended if extended in _installed else None


def _outside(variables) -> list[str]:
    return [getattr(v, "path", v.name) for v in variables
            if not isinstance(getattr(v, "value", v), ParallaxVariable)]


def check_scope(model, method: str) -> None:
    """Refuse (or, one process started by hand, warn about) a model whose variables the
    ParallaxStrategy of this process did not create."""
    if _extended_of(model) is not None:
        _check_compiled_inside(model, method)
        return
    extended = _job[0]() if _job[0] is not None else None
    foreign = _outside(model.trainable_weights)
    if extended is None or not foreign:
        return
    workers = extended.workers.info.size
    if method == "fit" and (workers > 1 or os.environ.get(RUN_ID_ENV)):
        raise ConfigError(
            f"model {model.name!r} was built outside strategy.scope() (its variables "
            f"{foreign[:3]} were not created by the ParallaxStrategy), so model.{method}() "
            f"would run it on this worker alone: each of the {workers} worker(s) would train "
            f"its own copy on all the data. Build and compile the model inside "
            f"`with strategy.scope():`")
    if (id(model), method) not in _warned:
        _warned.add((id(model), method))
        log.warning("model %r was built outside strategy.scope(), so model.%s() runs "
                    "without the ParallaxStrategy of this process (plain Keras, on this "
                    "worker's own, over all its data); if it is meant to train with the "
                    "strategy, build and compile it inside `with strategy.scope():`",
                    model.name, method)


def _check_compiled_inside(model, method: str) -> None:
    foreign = _outside(model.trainable_weights)
    if foreign:
        raise ConfigError(
            f"model.{method}() runs model {model.name!r} under a ParallaxStrategy, but its "
            f"variables {foreign[:3]} were created outside strategy.scope(), so parallax "
            f"cannot place them; build and compile the model inside "
            f"`with strategy.scope():`")
    optimizer = getattr(model, "optimizer", None)
    refuse_horovod_optimizer(optimizer)
    # the counter variable itself: with gradient_accumulation_steps, Keras' `iterations` is
    # a tensor computed from it
    iterations = getattr(optimizer, "_iterations", getattr(optimizer, "iterations", None))
    if method == "fit" and iterations is not None and _outside([iterations]):
        raise ConfigError(
            f"model {model.name!r} was built in strategy.scope() but compiled outside it: its "
            f"optimizer ({type(optimizer).__name__}) was created outside the scope, so its "
            f"variables are not the strategy's (most optimizers then stop in TF's \"Mixing "
            f"different tf.distribute.Strategy objects\"). Call model.compile(...) inside "
            f"`with strategy.scope():`")


def _guarded(method: str, original):
    @functools.wraps(original)
    def call(self, *args, **kwargs):
        check_scope(self, method)
        try:
            return original(self, *args, **kwargs)
        except tf.errors.OpError as exc:  # TF wraps a ParallaxError raised by an op
            raised = raised_in_op(exc)
            if raised is None:
                raise
            raise raised from None
    return call


# ---- functions traced before the plan; logs averaged outside Keras' loop ----------------

def _making(kind: str, original):
    @functools.wraps(original)
    def make(self, force=False):
        if _extended_of(self) is not None:
            _without_xla(self, kind)
        made = original(self, force)
        extended = _extended_of(self)
        if extended is not None and extended.plan is None and kind != "train":
            _unplanned[self] = weakref.ref(extended)
        if kind != "predict":
            attribute = f"{kind}_function"
            function = getattr(self, attribute)
            if function is not None and not getattr(function, _MARK, False):
                setattr(self, attribute, _averaging(self, function))
        return made
    return make


def _without_xla(model, kind: str) -> None:
    """`compile(jit_compile=True)` under the strategy: Keras' steps run without XLA, which
    cannot compile parallax's ops in them (row pulls and pushes, deferred variable reads),
    as Keras itself does, with a warning, for a model that does not support XLA."""
    if model.jit_compile is not True:
        return
    model.jit_compile = False
    if (id(model), "jit_compile") not in _warned:
        _warned.add((id(model), "jit_compile"))
        log.warning("model %r was compiled with jit_compile=True, but XLA cannot compile the "
                    "ops parallax adds to its steps (row pulls and pushes of the tables on "
                    "the servers, reads of variables before the plan): its %s function and "
                    "the others run with jit_compile=False. Compile with jit_compile=False "
                    "(or Keras' default, \"auto\", which is False under a tf.distribute "
                    "strategy) to silence this", model.name, kind)


def forget_functions(extended) -> None:
    """The plan was just made: drop the evaluate/predict functions that models of `extended`
    traced before it (they read variables locally), so Keras traces them again."""
    for model, owner in list(_unplanned.items()):
        if owner() is extended:
            model.test_function = None
            model.predict_function = None
            object.__setattr__(model, _BATCH_FUNCTION, None)
            del _unplanned[model]


def predicting_on_batch() -> bool:
    """Whether the predict step being traced is `predict_on_batch`'s: this worker's own
    batch, whose predictions are not gathered (`predict`'s are)."""
    return getattr(_state, "on_batch", False)


def _on_batch(original):
    """`predict_on_batch` predicts this worker's batch alone (no collective: one worker may
    call it without the others), with a predict function of its own."""
    @functools.wraps(original)
    def predict_on_batch(self, x):
        if _extended_of(self) is None:
            return original(self, x)
        shared = self.predict_function
        self.predict_function = getattr(self, _BATCH_FUNCTION, None)
        _state.on_batch = True
        try:
            return original(self, x)
        finally:
            _state.on_batch = False
            object.__setattr__(self, _BATCH_FUNCTION, self.predict_function)
            self.predict_function = shared
    return predict_on_batch


def in_loop() -> bool:
    """Whether the step being traced runs inside a `tf.while_loop` (Keras' multi-step
    loop), in its own graph or a graph it is nested in."""
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if control_flow_util_v2.in_while_loop_defun(graph):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def average_outside(model, extended) -> None:
    """`model`'s logs are averaged after each execution of its Keras function."""
    _averaged_outside[model] = weakref.ref(extended)


def _averaging(model, function):
    def averaged(iterator):
        logs = function(iterator)
        owner = _averaged_outside.get(model)
        extended = owner() if owner is not None else None
        return logs if extended is None else extended.average_logs(logs)
    setattr(averaged, _MARK, True)
    return averaged


# ---- datasets of evaluate and predict cover every row ------------------------------------

def covering_rows() -> bool:
    """Whether the dataset being distributed is Keras' evaluate or predict iterator's."""
    return getattr(_state, "covering", False)


def _chiefs_epoch(original):
    """`CallbackList.on_train_begin`, then where `fit` starts, on every worker the chief's:
    the epoch `BackupAndRestore` restored and, for a batch-level backup, the batches of it
    already trained, which the training iterator skips (`batch_resume`)."""
    @functools.wraps(original)
    def on_train_begin(self, logs=None):
        original(self, logs)
        model = getattr(self, "model", None)
        extended = _extended_of(model) if model is not None else None
        if extended is None:
            return
        workers = extended.workers
        # the epoch this worker's fit starts at, in Keras' own field
        mine = batch_resume.position(self.callbacks, model._initial_epoch)  # noqa: SLF001
        epoch, done = mine
        if workers.info.size > 1:
            _refuse_shared_backups(workers.allgather_object(_backup_dirs(self.callbacks)))
            epoch, done = workers.broadcast_object(mine if workers.info.is_chief else None)
            if (epoch, done) != mine:
                log.warning("worker %d: its backup resumes at epoch %s (batch %d), the "
                            "chief's at %s (batch %d): starting at the chief's (a save was cut "
                            "short on one of them, or this worker was not in the job at the "
                            "chief's last save: an elastic job's)", workers.info.rank, mine[0],
                            mine[1], epoch, done)
        epoch, done = _whole_epochs(epoch, done)
        model._initial_epoch = epoch  # noqa: SLF001 - Keras' field
        training = getattr(_state, "training", None)
        if training is not None and training() is not None:
            training().parallax_skip = done
        batch_resume.continue_backups(self.callbacks, epoch, done)
        if done:
            log.info("resuming epoch %d after its first %d batch(es), which the backup "
                     "already trained", epoch + 1, done)
    return on_train_begin


def _backups_epoch(original):
    """`CallbackList.on_epoch_begin`, with every `BackupAndRestore` recording the epoch `fit`
    runs (`batch_resume.begin_epoch`): Keras counts it from epoch ends only, so a `fit` from
    `initial_epoch=E` recorded epoch 0 in its batch-level backups until epoch E ended."""
    @functools.wraps(original)
    def on_epoch_begin(self, epoch, logs=None):
        model = getattr(self, "model", None)
        if model is not None and _extended_of(model) is not None:
            batch_resume.begin_epoch(self.callbacks, epoch)
        return original(self, epoch, logs)
    return on_epoch_begin


def _whole_epochs(epoch: int | None, done: int) -> tuple[int | None, int]:
    """(epoch, done) with an epoch whose every batch was done counted as the next one's
    start (its length known: steps_per_epoch, or the data's)."""
    training = getattr(_state, "training", None)
    iterator = training() if training is not None else None
    steps = iterator.num_batches if iterator is not None else None
    if epoch is not None and done and steps and done >= steps:
        return epoch + 1, 0
    return epoch, done


def _rescale_point(original):
    """`CallbackList.on_epoch_end`, then an elastic job's stop for a new worker count when
    the launcher asked for one and this epoch's callbacks saved a checkpoint
    (`rescale.stop_if_asked`)."""
    @functools.wraps(original)
    def on_epoch_end(self, epoch, logs=None):
        model = getattr(self, "model", None)
        extended = _extended_of(model) if model is not None else None
        saves = extended.server_tables.saves if extended is not None else 0
        original(self, epoch, logs)
        if extended is not None:
            epochs = (getattr(self, "params", None) or {}).get("epochs")
            rescale.stop_if_asked(
                extended, extended.server_tables.saves > saves, f"epoch {epoch + 1}",
                last=epochs is not None and epoch + 1 >= epochs,
                warn=batch_resume.batch_level_epoch(self.callbacks) is None)  # (batch ends)
    return on_epoch_end


def _rescale_at_backups(original):
    """`CallbackList.on_train_batch_end`, then, in a job the launcher may stop at a
    checkpoint (`rescale.stoppable`: elastic, or servers with copies) with a batch-level
    `BackupAndRestore` (whose backups come at batch ends, never at the epoch's end), the
    same stop as `_rescale_point` when this batch's callbacks saved one. Every worker
    joins the decision at each batch backed up (a broadcast: it stops at the same step
    everywhere), and only there."""
    @functools.wraps(original)
    def on_train_batch_end(self, batch, logs=None):
        model = getattr(self, "model", None)
        extended = _extended_of(model) if model is not None else None
        epoch = batch_resume.batch_level_epoch(self.callbacks) \
            if extended is not None and rescale.stoppable() else None
        if epoch is None:
            return original(self, batch, logs)
        saves = extended.server_tables.saves
        original(self, batch, logs)
        if not batch_resume.backed_up_now(self.callbacks):
            return None
        params = getattr(self, "params", None) or {}
        last = epoch + 1 >= (params.get("epochs") or 0) and batch + 1 >= (params.get("steps")
                                                                            or 0)
        rescale.stop_if_asked(extended, extended.server_tables.saves > saves,
                              f"epoch {epoch + 1}, batch {batch + 1}", last=last, warn=False)
    return on_train_batch_end


def _backup_dirs(callbacks) -> list[str]:
    """Where this worker's `BackupAndRestore` callbacks write: a URL as it is, a local
    directory made absolute and named with this host (the same path on two hosts' own
    disks is two directories; on one host, or at one URL, it is one)."""
    import keras
    host = socket.gethostname()
    return [path if "://" in path else f"{host}:{os.path.abspath(path)}"
            for path in (os.fspath(c.backup_dir) for c in callbacks
                         if isinstance(c, keras.callbacks.BackupAndRestore))]


def _refuse_shared_backups(every_workers: list[list[str]]) -> None:
    """Refuse one `BackupAndRestore` directory given to several workers: Keras 3 has every
    one of them write it and delete it at the end of `fit`, so one worker deleted it while
    another still saved (FileNotFoundError at the end of `fit`). Seen per host: a shared
    file system mounted on several hosts under one path is not seen."""
    ranks: dict[str, list[int]] = {}
    for rank, paths in enumerate(every_workers):
        for path in set(paths):
            ranks.setdefault(path, []).append(rank)
    shared = {path: who for path, who in ranks.items() if len(who) > 1}
    if shared:
        path, who = next(iter(sorted(shared.items())))
        raise ConfigError(
            f"BackupAndRestore's directory {path!r} is given to workers {who}: Keras 3 has "
            f"each of them write it and delete it at the end of fit, so one deletes it while "
            f"another still saves. Give each worker its own, e.g. BackupAndRestore(os.path."
            f"join(backup_dir, f\"worker-{{strategy.worker.rank}}\")): every worker then "
            f"resumes at the chief's epoch, with the chief's tables")


def _covering_iterator(base):
    class CoveringIterator(base):
        def __init__(self, *args, **kwargs):
            _state.covering = "class_weight" not in kwargs  # only fit's training passes it
            try:
                super().__init__(*args, **kwargs)
            finally:
                _state.covering = False
            self._parallax_drops = "class_weight" in kwargs and _several_workers(
                self._distribute_strategy)
            self.parallax_skip = 0  # batches of the first epoch a resumed backup trained
            if "class_weight" in kwargs:  # fit's training data: where it resumes is set
                _state.training = weakref.ref(self)  # at on_train_begin (_chiefs_epoch)
            self._parallax_full: int | None = None  # full batches, once learned
            self._count_full_batches()

        def reset(self):
            super().reset()
            self._count_full_batches()

        def _enumerate_iterator(self):
            """Keras' steps of an epoch; the first `parallax_skip` of the first epoch
            after a mid-epoch resume are read and dropped (trained before the backup)."""
            skip, self.parallax_skip = self.parallax_skip, 0
            for begin, end, iterator in super()._enumerate_iterator():
                if begin >= skip:
                    yield begin, end, iterator
                    continue
                try:
                    for _ in range(self.steps_per_execution):
                        next(iterator)
                except StopIteration:  # the data ended within the skipped batches
                    return

        def _count_full_batches(self) -> None:
            """Keras' count of training batches, less a last, partial global batch, which
            every worker drops (`datasets.shard_for_worker`): counted, it would end every
            epoch with "Your input ran out of data" on every worker. Arrays say whether
            there is one; a dataset of known length is learned from at its first end."""
            if not getattr(self, "_parallax_drops", False) or not self._num_batches:
                return
            try:
                partial = self.data_adapter.has_partial_batch
            except NotImplementedError:  # a keras.utils.PyDataset's adapter cannot say
                partial = None
            if partial:
                self._parallax_full = self.data_adapter.num_batches - 1
            if self._parallax_full is not None:
                self._num_batches = self._parallax_full

        def _interrupted_warning(self):
            """Keras' warning, unless the data ran out at the very batch parallax dropped:
            the last of a dataset of known length (then the count is one less from now)."""
            known = self.data_adapter.num_batches
            if self._parallax_drops and self.steps_per_epoch is None and known and \
                    self._parallax_full is None and \
                    self._steps_seen - self.steps_per_execution < known <= self._steps_seen:
                self._parallax_full = self._num_batches = known - 1
                log.debug("the last global batch of the training data is partial: every "
                          "worker drops it (%d steps an epoch)", known - 1)
                return
            super()._interrupted_warning()
    CoveringIterator.__name__ = base.__name__
    CoveringIterator.__qualname__ = base.__qualname__
    return CoveringIterator


def _several_workers(strategy) -> bool:
    """Whether `strategy` is a parallax job's of several workers."""
    extended = getattr(strategy, "extended", None)
    return extended in _installed and extended.workers.info.size > 1


# ---- beside fit, evaluate and predict ----------------------------------------------------

# ---- the optimizer's state in a weights file loaded before the optimizer is built --------
# Keras skips the variables of an optimizer not built yet ("Skipping variable loading for
# optimizer ..."), so a job resumed by `load_weights` before its first step got its tables'
# optimizer slots back from the servers but its dense optimizer state from initial values:
# not an exact resume. In a ParallaxStrategy the optimizer keeps the file's state aside
# and loads it once `fit` (or evaluate, train_on_batch...) has built it, with every variable
# trainable then (a layer frozen while loading and unfrozen before training too), as
# Keras' own `BackupAndRestore` loads after building. An optimizer first built elsewhere
# (a custom loop's first `apply`) drops it with Keras' warning.
_DEFERRED = "_parallax_deferred_state"


def _deferring_optimizer_state(original):
    @functools.wraps(original)
    def load_weights(self, *args, **kwargs):
        before = getattr(_state, "deferring", False)
        _state.deferring = _extended_of(self) is not None
        try:
            return original(self, *args, **kwargs)
        finally:
            _state.deferring = before

    return load_weights


def _kept_until_built(original):
    @functools.wraps(original)
    def load_own_variables(self, store):
        self.__dict__.pop(_DEFERRED, None)  # (a newer file's state replaces it)
        if getattr(_state, "deferring", False) and not self.built and \
                len(store.keys()) > len(self.variables):
            setattr(self, _DEFERRED, {key: np.array(store[key]) for key in store.keys()})
            return None
        return original(self, store)

    return load_own_variables


def _loading_deferred_state(original):
    @functools.wraps(original)
    def _symbolic_build(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        optimizer = getattr(self, "optimizer", None)
        deferred = None if optimizer is None else optimizer.__dict__.pop(_DEFERRED, None)
        if deferred is not None and optimizer.built:
            optimizer.load_own_variables(deferred)  # (Keras warns if the counts differ)
        return result

    return _symbolic_build


def _dropping_deferred_state(original):
    @functools.wraps(original)
    def apply(self, *args, **kwargs):
        deferred = self.__dict__.pop(_DEFERRED, None)
        if deferred is not None:
            warnings.warn(f"Skipping variable loading for optimizer '{self.name}': "
                          f"load_weights found it not built, and it was first built by "
                          f"`apply`, not by `fit`, so the file's {len(deferred)} optimizer "
                          f"variables were not loaded; build it before loading "
                          f"(`model.optimizer.build(model.trainable_variables)`)",
                          stacklevel=2)
        return original(self, *args, **kwargs)

    return apply


def make_weight_saves_atomic() -> None:
    """Wrap `keras.Model.save_weights` once: a local file is written under a temporary name
    in the same directory, then renamed over `filepath` (os.replace, atomic on POSIX); on
    failure the temporary file is removed and the old file is untouched. Remote paths
    (`scheme://`) go to Keras unchanged."""
    import keras
    original = keras.Model.save_weights
    if getattr(original, _ATOMIC_MARK, False):
        return

    def save_weights(self, filepath, overwrite=True, **kwargs):
        path = os.fspath(filepath)
        if "://" in path or not path.endswith(_WEIGHTS_SUFFIX):
            return original(self, filepath, overwrite=overwrite, **kwargs)
        if not overwrite and os.path.exists(path):
            return original(self, filepath, overwrite=overwrite, **kwargs)  # Keras asks
        directory, name = os.path.split(path)
        temporary = os.path.join(directory, f".{name[:-len(_WEIGHTS_SUFFIX)]}.parallax-"
                                            f"{os.getpid()}{_WEIGHTS_SUFFIX}")
        try:
            original(self, temporary, overwrite=True, **kwargs)
            os.replace(temporary, path)
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)

    setattr(save_weights, _ATOMIC_MARK, True)
    save_weights.__wrapped__ = original
    save_weights.__doc__ = original.__doc__
    keras.Model.save_weights = save_weights


def make_backup_records_atomic() -> None:
    """Replace `BackupAndRestore._save_model` once (Keras 3.15's, with one change): its
    record of where the backup was taken ({"epoch", "batch"}, beside the weights) is written
    under a temporary name and renamed into place, as the weights are
    (`make_weight_saves_atomic`). Keras writes it in place: a process killed while writing
    it left an empty or half JSON file, which failed every later resume (JSONDecodeError;
    the `.bkp` fallback only takes OSError). Remote paths (`scheme://`) are written as Keras
    does. `_load_model` too, for held backups (`held_backups`: a local directory only)."""
    import keras
    from keras.src.utils import file_utils
    backup = keras.callbacks.BackupAndRestore
    if getattr(backup._save_model, _ATOMIC_MARK, False):  # noqa: SLF001 - Keras' method
        return

    original_load = backup._load_model  # noqa: SLF001 - Keras' method

    def _save_model(self):
        if not file_utils.exists(self.backup_dir):
            file_utils.makedirs(self.backup_dir)
        extended = _extended_of(self.model)
        if extended is not None and extended.remotes and held_backups.save(self, extended):
            return
        for path, previous in ((self._weights_path, self._prev_weights_path),
                               (self._training_metadata_path,
                                self._prev_training_metadata_path)):
            if self.double_checkpoint and file_utils.exists(path):
                file_utils.copy(path, previous)
        self.model.save_weights(filepath=self._weights_path, overwrite=True)
        record = json.dumps({"epoch": self._current_epoch, "batch": self._last_batch_seen})
        _write_whole(self._training_metadata_path, record, file_utils)
        if extended is not None and extended.remotes:
            held_backups.saved_on_disk(self, extended)

    def _load_model(self):
        extended = _extended_of(self.model)
        if extended is None or not held_backups.load(self, extended):
            original_load(self)

    original_end = backup.on_train_end

    def on_train_end(self, logs=None):
        original_end(self, logs)
        extended = _extended_of(self.model)
        if extended is not None and extended.remotes:  # a finished fit resumes from none
            extended.server_tables.release_held()  # held (else a later fit of the run did)

    setattr(_save_model, _ATOMIC_MARK, True)
    backup._save_model = _save_model  # noqa: SLF001 - Keras' method
    backup._load_model = _load_model  # noqa: SLF001 - Keras' method
    backup.on_train_end = on_train_end


def _write_whole(path: str, text: str, file_utils) -> None:
    if "://" in path:
        with file_utils.File(path, "w") as f:
            f.write(text)
        return
    temporary = f"{path}.parallax-{os.getpid()}"
    try:
        with open(temporary, "w") as f:
            f.write(text)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


def _remote_storage(x):
    value = getattr(x, "value", None) if not isinstance(x, tf.Variable) else x
    if isinstance(value, tf.Variable) and remote_of(value) is not None:
        return value
    return None


def route_keras_take() -> None:
    """Idempotent: install the `take` routing described in the module docstring."""
    from keras.src.backend.tensorflow import numpy as tf_numpy

    original = tf_numpy.take
    if getattr(original, _ROUTED_MARK, False):
        return

    def take(x, indices, axis=None):
        remote = _remote_storage(x) if axis == 0 else None
        if remote is None or isinstance(indices, tf.SparseTensor):
            return original(x, indices, axis=axis)
        return remote.sparse_read(tf.convert_to_tensor(indices))

    take.__doc__ = original.__doc__
    setattr(take, _ROUTED_MARK, True)
    take.__wrapped__ = original
    tf_numpy.take = take


def check_sparse_values_only() -> None:
    """Idempotent: LossScaleOptimizer's finite check reads IndexedSlices' values only."""
    from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

    original = LossScaleOptimizer.check_finite
    if getattr(original, _ROUTED_MARK, False):
        return

    def check_finite(self, grads):
        return original(self, [g.values if isinstance(g, tf.IndexedSlices) else g
                               for g in grads])

    check_finite.__doc__ = original.__doc__
    setattr(check_finite, _ROUTED_MARK, True)
    check_finite.__wrapped__ = original
    LossScaleOptimizer.check_finite = check_finite


def attach_to_keras_optimizers() -> None:
    """Idempotent: Keras optimizers made in a ParallaxStrategy's scope get its
    `resume.ServerTables` as the attribute `parallax_server_tables` (see the module docstring)."""
    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.optimizer import Optimizer
    from keras.src.saving import saving_lib

    _naming_the_file(saving_lib, "load_model", "filepath", "Keras file")
    _naming_the_file(saving_lib, "load_weights_only", "filepath", "Keras file")
    _naming_the_file(tf.train.Checkpoint, "restore", "save_path", "TensorFlow checkpoint")
    original = TFOptimizer.__init__
    if getattr(original, _TABLES_MARK, False):
        return

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        tables = getattr(self._distribution_strategy.extended, "server_tables", None)
        # Keras lists a bare Optimizer's attributes as those never to save: not this one.
        if isinstance(tables, resume.ServerTables) and type(self) is not Optimizer:
            setattr(self, resume.ATTRIBUTE, tables)

    setattr(__init__, _TABLES_MARK, True)
    __init__.__wrapped__ = original
    TFOptimizer.__init__ = __init__


def _naming_the_file(owner, name: str, argument: str, kind: str) -> None:
    """Idempotent: while `owner.name` runs, `resume.LOADING` names the file its `argument` gives
    (as "<kind> <path>"), so a warning about a file's tables can say which file."""
    original = getattr(owner, name)
    if getattr(original, _TABLES_MARK, False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def load(*args, **kwargs):
        try:
            path = signature.bind(*args, **kwargs).arguments.get(argument)
        except TypeError:
            path = None  # the call itself will say what is wrong
        named = isinstance(path, (str, os.PathLike))
        token = resume.LOADING.set(f"{kind} {os.fspath(path)}" if named else "")
        try:
            return original(*args, **kwargs)
        finally:
            resume.LOADING.reset(token)

    setattr(load, _TABLES_MARK, True)
    setattr(owner, name, load)
