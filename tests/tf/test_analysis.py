"""parallax.tf.graph.analysis: which variables are read only by row gathers, in real traced train
steps.

Every case traces a real model with tf.function; most include the GradientTape and a Keras
optimizer update in the traced step, because gradient and update code read variables too.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from parallax.tf.graph.analysis import ReadReport, inspect_reads

IDS = tf.TensorSpec((None, 3), tf.int32)
FLAG = tf.TensorSpec((), tf.bool)


def trace(fn, *specs):
    """The graph tf.function traces for `fn` (what the strategy inspects)."""
    return tf.function(fn).get_concrete_function(*specs).graph


def keras_step(model, optimizer):
    """A custom-training-loop step: forward, tape.gradient, optimizer.apply_gradients."""
    def step(ids):
        with tf.GradientTape() as tape:
            out = model(ids, training=True)
            loss = tf.reduce_mean(tf.square(tf.cast(out, tf.float32)))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def variable_step(variables, forward, optimizer, *specs):
    """Trace a step whose loss is `forward(*inputs)` over raw tf.Variables, with an update."""
    def step(*inputs):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(forward(*inputs))
        grads = tape.gradient(loss, variables)
        optimizer.apply_gradients(zip(grads, variables))
        return loss
    return trace(step, *specs)


def table(rows=50, dim=4, name="table"):
    return tf.Variable(tf.random.normal((rows, dim)), name=name)


def embedding_dense_model(vocab=40, dim=8):
    model = keras.Sequential([
        keras.layers.Embedding(vocab, dim, name="emb"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(2, name="dense"),
    ])
    model.build((None, 3))
    return model


@pytest.fixture
def mixed_float16():
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        yield
    finally:
        keras.mixed_precision.set_global_policy(previous)


def assert_gather_only(report: ReadReport, reads: int, chain: str = "") -> None:
    assert report.gather_only, report.reason
    assert report.gather_reads == reads
    assert report.dense_reads == ()
    assert report.reason.startswith("every read is a row gather on axis 0 (")
    assert chain in report.reason


def assert_dense(report: ReadReport, op_type: str) -> None:
    assert not report.gather_only
    assert report.dense_reads, report
    assert any(read.startswith(f"{op_type} '") for read in report.dense_reads), report
    assert op_type in report.reason


# 1
@pytest.mark.parametrize("optimizer", [
    lambda: keras.optimizers.SGD(0.1), lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    lambda: keras.optimizers.Adam(), lambda: keras.optimizers.Adagrad(),
], ids=["sgd", "momentum", "adam", "adagrad"])
def test_keras_embedding_is_gather_only_and_dense_layer_is_dense(optimizer):
    model = embedding_dense_model()
    emb, kernel, bias = model.trainable_variables
    reports = inspect_reads(trace(keras_step(model, optimizer()), IDS), [emb, kernel, bias])
    assert_gather_only(reports[id(emb)], 1, "ReadVariableOp->GatherV2 x1")
    assert_dense(reports[id(kernel)], "MatMul")
    assert reports[id(kernel)].reason.startswith("read densely by MatMul '")
    assert "tied" not in reports[id(kernel)].reason  # no gather: just a dense layer
    assert len(reports[id(kernel)].dense_reads) == 2  # the forward MatMul and its gradient's
    assert_dense(reports[id(bias)], "BiasAdd")


def test_keys_are_ids_of_the_objects_passed_in():
    model = embedding_dense_model()
    emb = model.trainable_variables[0]
    graph = trace(keras_step(model, keras.optimizers.SGD()), IDS)
    assert isinstance(emb, keras.Variable)
    by_keras = inspect_reads(graph, [emb])
    by_tf = inspect_reads(graph, [emb.value])
    assert list(by_keras) == [id(emb)] and list(by_tf) == [id(emb.value)]
    assert by_keras[id(emb)] == by_tf[id(emb.value)]


# 2
def test_embedding_lookup_and_tf_gather_on_variables_are_resource_gathers():
    t1, t2, w = table(name="t1"), table(name="t2"), tf.Variable(tf.ones((4, 1)))
    graph = variable_step(
        [t1, t2, w],
        lambda ids: tf.matmul(tf.nn.embedding_lookup(t1, ids[:, 0]) + tf.gather(t2, ids[:, 1]), w),
        keras.optimizers.SGD(0.1), IDS)
    reports = inspect_reads(graph, [t1, t2, w])
    assert_gather_only(reports[id(t1)], 1, "(ResourceGather x1)")
    assert_gather_only(reports[id(t2)], 1, "(ResourceGather x1)")
    assert_dense(reports[id(w)], "MatMul")


@pytest.mark.parametrize("name, scatter", [
    ("SGD", "ResourceScatterSub"), ("Adagrad", "ResourceScatterAdd"),
    ("RMSprop", "ResourceScatterSub"), ("Adam", None)])
def test_optimizer_updates_including_sparse_scatters_are_not_reads(name, scatter):
    t = table()
    graph = variable_step([t], lambda ids: tf.gather(t, ids), getattr(keras.optimizers, name)(),
                          IDS)
    assert_gather_only(inspect_reads(graph, [t])[id(t)], 1, "(ResourceGather x1)")
    if scatter:  # Keras 3 applies IndexedSlices gradients with a scatter on the handle
        assert scatter in {op.type for op in graph.get_operations()}


@pytest.mark.parametrize("name, prefix", [("AdamW", "adam_w/"), ("Ftrl", "ftrl/")])
def test_optimizers_that_read_the_whole_table_make_it_dense(name, prefix):
    t = table()
    # named: Keras numbers an unnamed optimizer's scope after earlier ones ("ftrl_2/")
    optimizer = (keras.optimizers.AdamW(weight_decay=0.01, name="adam_w") if name == "AdamW"
                 else keras.optimizers.Ftrl(name="ftrl"))
    graph = variable_step([t], lambda ids: tf.gather(t, ids), optimizer, IDS)
    report = inspect_reads(graph, [t])[id(t)]
    assert not report.gather_only and report.gather_reads == 1
    assert report.reason.startswith("also read by Mul '" + prefix)
    assert all(prefix in read for read in report.dense_reads)


# 3
def test_one_embedding_called_on_two_inputs_counts_two_gathers():
    emb = keras.layers.Embedding(30, 4)
    a, b = keras.Input((3,), dtype="int32"), keras.Input((2,), dtype="int32")
    pooled = keras.layers.Concatenate(axis=1)([emb(a), emb(b)])
    model = keras.Model([a, b], keras.layers.Dense(1)(keras.layers.Flatten()(pooled)))
    step = keras_step(model, keras.optimizers.Adam())
    graph = trace(lambda x, y: step([x, y]), IDS, tf.TensorSpec((None, 2), tf.int32))
    assert_gather_only(inspect_reads(graph, [emb.embeddings])[id(emb.embeddings)], 2,
                       "ReadVariableOp->GatherV2 x2")


# 4
def test_tied_input_output_embedding_is_dense_because_of_matmul():
    class Tied(keras.Model):
        def __init__(self):
            super().__init__()
            self.emb = keras.layers.Embedding(30, 4)

        def call(self, ids):
            h = tf.reduce_mean(self.emb(ids), axis=1)
            return tf.matmul(h, self.emb.embeddings, transpose_b=True)

    model = Tied()
    model(tf.zeros((1, 3), tf.int32))
    graph = trace(keras_step(model, keras.optimizers.Adam()), IDS)
    report = inspect_reads(graph, [model.emb.embeddings])[id(model.emb.embeddings)]
    assert_dense(report, "MatMul")
    assert report.gather_reads == 1
    assert report.reason.startswith("also read by MatMul '")
    assert "tied softmax weights" in report.reason


# 5
def test_mixed_precision_keeps_the_classification(mixed_float16):
    model = embedding_dense_model()
    emb, kernel, bias = model.trainable_variables
    assert model.layers[2].compute_dtype == "float16"
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())
    graph = trace(keras_step(model, optimizer), IDS)
    reports = inspect_reads(graph, [emb, kernel, bias])
    # Keras 3's Embedding gathers the float32 table and casts the rows, not the table.
    assert_gather_only(reports[id(emb)], 1, "ReadVariableOp->GatherV2 x1")
    assert_dense(reports[id(kernel)], "MatMul")
    assert_dense(reports[id(bias)], "BiasAdd")
    kernel_read = [op for op in graph.get_operations() if op.type == "Cast"
                   and op.inputs[0].op.type == "ReadVariableOp" and "dense" in op.name]
    assert kernel_read, "Keras autocasts the Dense kernel: ReadVariableOp -> Cast -> MatMul"


def test_autocast_variable_read_through_cast_is_still_a_gather(mixed_float16):
    class Lookup(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(shape=(30, 4), name="table")

        def call(self, ids):
            return keras.ops.take(self.table, ids, axis=0)

    layer = Lookup()
    ids = keras.Input((3,), dtype="int32")
    model = keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(layer(ids))))
    graph = trace(keras_step(model, keras.optimizers.SGD(0.1)), IDS)
    assert_gather_only(inspect_reads(graph, [layer.table])[id(layer.table)], 1,
                       "ReadVariableOp->Cast->GatherV2 x1")


# 6
def test_several_tables_are_all_gather_only():
    sizes = [(10, 2), (100, 4), (1000, 8)]
    inputs = [keras.Input((3,), dtype="int32") for _ in sizes]
    layers = [keras.layers.Embedding(n, d) for n, d in sizes]
    pooled = [keras.layers.GlobalAveragePooling1D()(e(x)) for e, x in zip(layers, inputs)]
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Concatenate()(pooled)))
    step = keras_step(model, keras.optimizers.Adagrad())
    graph = trace(lambda a, b, c: step([a, b, c]), IDS, IDS, IDS)
    tables = [layer.embeddings for layer in layers]
    reports = inspect_reads(graph, tables + list(model.layers[-1].trainable_variables))
    for t in tables:
        assert_gather_only(reports[id(t)], 1)
    assert [r.gather_only for r in reports.values()] == [True, True, True, False, False]


# 7
def test_dense_regulariser_on_a_table_is_named():
    t = table()
    graph = variable_step(
        [t], lambda ids: tf.gather(t, ids) + 0.01 * tf.reduce_sum(tf.square(t.read_value())),
        keras.optimizers.SGD(0.1), IDS)
    report = inspect_reads(graph, [t])[id(t)]
    assert_dense(report, "Square")
    assert report.gather_reads == 1
    assert report.reason.startswith("also read by Square '")
    assert "tied" not in report.reason


def test_keras_embedding_regulariser_reads_densely():
    model = keras.Sequential([
        keras.layers.Embedding(30, 4, embeddings_regularizer=keras.regularizers.L2(0.01)),
        keras.layers.Flatten(), keras.layers.Dense(1)])
    model.build((None, 3))

    def step(ids):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(ids)) + tf.add_n(model.losses)
        return tape.gradient(loss, model.trainable_variables)

    emb = model.layers[0].embeddings
    report = inspect_reads(trace(step, IDS), [emb])[id(emb)]
    assert not report.gather_only and report.gather_reads == 1
    assert report.dense_reads[0].startswith("Square '")


# 8
def test_reads_inside_cond_while_and_nested_functions_are_followed():
    t_cond, t_while, t_nested, t_case = (table(name=n) for n in ("c", "w", "n", "k"))
    emb = keras.layers.Embedding(30, 4)
    emb.build((None, 3))

    @tf.function
    def nested(ids):
        return tf.gather(t_nested, ids) + emb(ids)

    def forward(ids, flag):
        a = tf.cond(flag, lambda: tf.gather(t_cond, ids), lambda: tf.gather(t_cond, ids + 1))
        b = tf.while_loop(lambda i, acc: i < 2,
                          lambda i, acc: (i + 1, acc + tf.gather(t_while, ids)),
                          (0, tf.zeros_like(a)))[1]
        c = tf.switch_case(tf.cast(flag, tf.int32), [lambda: tf.gather(t_case, ids)] * 2)
        return a + b + c + nested(ids)

    variables = [t_cond, t_while, t_nested, t_case, emb.embeddings]
    graph = variable_step(variables, forward, keras.optimizers.Adam(), IDS, FLAG)
    types = {op.type for op in graph.get_operations()}
    assert {"If", "While", "Case", "StatefulPartitionedCall"} <= types
    reports = inspect_reads(graph, variables)
    assert_gather_only(reports[id(t_cond)], 2, "If->ResourceGather x2")
    assert_gather_only(reports[id(t_while)], 1, "While->ResourceGather x1")
    assert_gather_only(reports[id(t_case)], 2, "Case->ResourceGather x2")
    assert_gather_only(reports[id(t_nested)], 1, "StatefulPartitionedCall->ResourceGather x1")
    assert_gather_only(reports[id(emb.embeddings)], 1,
                       "StatefulPartitionedCall->ReadVariableOp->GatherV2 x1")


def test_dense_read_inside_a_branch_names_where_it_is():
    t = table()
    graph = trace(lambda ids, flag: tf.cond(flag, lambda: tf.gather(t, ids),
                                            lambda: tf.zeros((3, 4)) + tf.reduce_mean(t)),
                  tf.TensorSpec((3,), tf.int32), FLAG)
    report = inspect_reads(graph, [t])[id(t)]
    assert not report.gather_only and report.gather_reads == 1
    assert report.dense_reads[0].startswith("Mean '")
    assert " in If 'cond'" in report.dense_reads[0]


def test_read_value_passed_through_a_loop_is_followed_inside_and_after_it():
    t = table()

    def step(ids, read_after):
        _, x, acc = tf.while_loop(lambda i, x, acc: i < 2,
                                  lambda i, x, acc: (i + 1, x, acc + tf.gather(x, ids)),
                                  (0, t.read_value(), tf.zeros((3, 4))))
        return acc + tf.reduce_max(x) if read_after else acc

    spec = tf.TensorSpec((3,), tf.int32)
    inside = inspect_reads(trace(lambda ids: step(ids, False), spec), [t])[id(t)]
    assert_gather_only(inside, 1, "ReadVariableOp->Identity->StatelessWhile->GatherV2 x1")
    after = inspect_reads(trace(lambda ids: step(ids, True), spec), [t])[id(t)]
    assert after.gather_reads == 1
    assert after.dense_reads == ("Max 'Max'",)  # the loop's output, read in the step itself


def test_variable_used_as_a_cond_predicate_is_a_dense_read():
    flag, t = tf.Variable(True), table()
    graph = trace(lambda ids: tf.cond(flag, lambda: tf.gather(t, ids), lambda: tf.gather(t, ids)),
                  IDS)
    reports = inspect_reads(graph, [flag, t])
    assert_dense(reports[id(flag)], "If")
    assert_gather_only(reports[id(t)], 2, "If->ResourceGather x2")


# 9
def test_unused_or_only_updated_variable_is_not_read():
    t, unused = table(), table(name="unused")
    graph = variable_step([t], lambda ids: tf.gather(t, ids), keras.optimizers.SGD(0.1), IDS)
    not_read = ReadReport(False, "not read in the traced step", 0, ())
    assert inspect_reads(graph, [unused])[id(unused)] == not_read

    def only_updated(ids):
        t.scatter_sub(tf.IndexedSlices(tf.ones((3, 4)), ids))
        t.assign_add(tf.ones((50, 4)))

    graph = trace(only_updated, tf.TensorSpec((3,), tf.int32))
    assert inspect_reads(graph, [t])[id(t)] == not_read


# 10
@pytest.mark.parametrize("axis", [1, -1])
def test_gather_on_another_axis_is_dense(axis):
    t = table()
    graph = trace(lambda ids: tf.gather(t, ids, axis=axis), tf.TensorSpec((3,), tf.int32))
    report = inspect_reads(graph, [t])[id(t)]
    assert_dense(report, "GatherV2")
    assert report.gather_reads == 0


def test_gather_with_negative_axis_meaning_rows_is_a_gather():
    t = table()
    graph = variable_step([t], lambda ids: tf.gather(t, ids, axis=-2), keras.optimizers.SGD(0.1),
                          tf.TensorSpec((3,), tf.int32))
    assert_gather_only(inspect_reads(graph, [t])[id(t)], 1, "ReadVariableOp->GatherV2 x1")


def test_unknown_shape_table_shape_reads_are_harmless_but_unknown_axis_is_not():
    t = tf.Variable(tf.zeros((5, 4)), shape=tf.TensorShape(None))  # Shape is not a constant
    rows = variable_step([t], lambda ids: tf.gather(t.read_value(), ids),
                         keras.optimizers.SGD(0.1), tf.TensorSpec((3,), tf.int32))
    consumers = {c.type for op in rows.get_operations() if op.type == "Identity"
                 and op.inputs[0].op.type == "ReadVariableOp" for c in op.outputs[0].consumers()}
    assert "Shape" in consumers  # the gather's gradient asks for the table's shape
    assert_gather_only(inspect_reads(rows, [t])[id(t)], 1, "ReadVariableOp->Identity->GatherV2")
    last = trace(lambda ids: tf.gather(t.read_value(), ids, axis=-2), tf.TensorSpec((3,), tf.int32))
    assert_dense(inspect_reads(last, [t])[id(t)], "GatherV2")  # rank unknown: -2 may not be 0


def test_batched_gather_and_returned_table_are_dense():
    t = table()
    ids = tf.TensorSpec((50, 2), tf.int32)
    batched = trace(lambda i: tf.gather(tf.reshape(t, (50, 1, 4)), i, batch_dims=1), ids)
    assert_dense(inspect_reads(batched, [t])[id(t)], "Reshape")
    returned = trace(lambda: t.read_value() * 1.0)
    assert_dense(inspect_reads(returned, [t])[id(t)], "Mul")
    whole = inspect_reads(trace(lambda: tf.identity(t)), [t])[id(t)]
    assert not whole.gather_only and "Return '" in whole.dense_reads[0]


def test_handle_passed_into_an_unknown_op_cannot_be_inspected():
    counter = tf.Variable(np.int64(0))
    graph = trace(lambda: tf.raw_ops.ResourceCountUpTo(resource=counter.handle, limit=9,
                                                       T=tf.int64))
    report = inspect_reads(graph, [counter])[id(counter)]
    assert not report.gather_only
    assert report.reason.startswith("passed into ResourceCountUpTo '")
    assert report.reason.endswith("which parallax cannot inspect")
    assert len(report.dense_reads) == 1
    assert report.dense_reads[0].startswith("ResourceCountUpTo '")


def test_variable_created_inside_a_plain_graph():
    with tf.Graph().as_default() as graph:
        t = tf.Variable(tf.zeros((50, 4)))
        w = tf.Variable(tf.zeros((4, 1)))
        tf.matmul(tf.gather(t, tf.constant([1, 2])), w)
    reports = inspect_reads(graph, [t, w])
    assert_gather_only(reports[id(t)], 1, "(ResourceGather x1)")
    assert_dense(reports[id(w)], "MatMul")


def test_variable_used_as_indices_or_batched_resource_gather_is_dense():
    perm = tf.Variable([2, 0, 1])
    x = tf.constant([[1.0], [2.0], [3.0]])
    as_indices = trace(lambda: tf.gather(x, perm.read_value()))
    assert_dense(inspect_reads(as_indices, [perm])[id(perm)], "GatherV2")
    t = table()
    batched = trace(lambda ids: tf.raw_ops.ResourceGather(
        resource=t.handle, indices=ids, dtype=tf.float32, batch_dims=1), IDS)
    assert_dense(inspect_reads(batched, [t])[id(t)], "ResourceGather")
