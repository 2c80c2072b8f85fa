"""Loading a saved Keras model for distributed training, and the TF-only global broadcast.

``load_model`` loads with Keras and then swaps the model's optimizer for a
:func:`DistributedOptimizer` copy carrying the loaded optimizer state
(iteration count, slots), so training resumes where it stopped, on every
optimizer class -- custom ones included -- without a table of wrapped
classes.
"""

from __future__ import annotations

import keras

from .backend import FRONTEND, Compression
from .optimizer import DistributedOptimizer


def _custom_objects(custom_optimizers, custom_objects) -> dict:
    objects = {}
    for cls in custom_optimizers or ():
        if not (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)):
            raise TypeError(f"{FRONTEND}.load_model: custom_optimizers must list "
                            f"keras.optimizers.Optimizer subclasses, got {cls!r}")
        objects[cls.__name__] = cls
    objects.update(custom_objects or {})
    return objects


def _state_holder(optimizer):
    """The optimizer whose variables are the trained state (inside any loss scaling)."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        return optimizer.inner_optimizer
    return optimizer


def _carry_state(loaded, wrapped, model) -> None:
    """Build ``wrapped`` and give it ``loaded``'s variables, in the same order."""
    if not loaded.built:
        return
    wrapped.build(model.trainable_variables)
    source, target = loaded, wrapped
    if len(source.variables) != len(target.variables):
        source, target = _state_holder(loaded), _state_holder(wrapped)
    if len(source.variables) != len(target.variables):
        raise ValueError(f"{FRONTEND}.load_model: the loaded optimizer has "
                         f"{len(source.variables)} variables, its distributed copy "
                         f"{len(target.variables)}; cannot carry its state over")
    for src, dst in zip(source.variables, target.variables):
        dst.assign(src.value)


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, legacy_opts=False):
    """Load a saved Keras model whose optimizer averages gradients across ranks.

    Args:
        filepath: a path Keras's ``keras.models.load_model`` accepts
            (``.keras``, ``.h5``).
        custom_optimizers: optimizer classes the file uses beyond Keras's own.
        custom_objects: further names to classes or functions, as Keras takes them.
        compression: passed to :func:`DistributedOptimizer`.
        legacy_opts: Horovod's switch to TensorFlow's ``keras.optimizers.legacy``
            classes. Keras 3 has no legacy optimizers, and the optimizer class
            the file names is the one wrapped either way, so it changes
            nothing; accepted so Horovod scripts run unchanged.

    Returns:
        The model; if it was saved compiled, ``model.optimizer`` is a
        DistributedOptimizer holding the saved optimizer state.

    Example:
        >>> model = hvd.load_model("checkpoint.keras")
        >>> model.fit(x_shard, y_shard, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    """
    del legacy_opts  # Keras 3 has no legacy optimizer classes to choose (see above)
    model = keras.models.load_model(filepath, custom_objects=_custom_objects(
        custom_optimizers, custom_objects))
    loaded = getattr(model, "optimizer", None)
    if loaded is None:
        return model
    wrapped = DistributedOptimizer(loaded, compression=compression)
    _carry_state(loaded, wrapped, model)
    model.optimizer = wrapped
    return model


def broadcast_global_variables(root_rank):
    """Not available in Keras 3, as in Horovod under TensorFlow 2's eager execution.

    Keras 3 has no collection of global variables; broadcast the model's and
    optimizer's variables instead.
    """
    raise RuntimeError(f"{FRONTEND}.broadcast_global_variables: Keras 3 has no global "
                       f"variables; use hvd.broadcast_variables(model.variables + "
                       f"model.optimizer.variables, root_rank={root_rank!r}) or "
                       f"hvd.callbacks.BroadcastGlobalVariablesCallback({root_rank!r})")
