"""``model.fit`` on several ranks with Keras 3 (torch or JAX backend) and hvdlike.keras.

Run on two ranks (or one, for comparison)::

    hvdlike-run -np 2 python examples/keras_fit.py
    KERAS_BACKEND=jax hvdlike-run -np 2 python examples/keras_fit.py

The digits data set is cut into global batches of ``--batch`` examples; rank
``r`` trains on the ``r``-th slice of every global batch. The distributed
optimizer averages gradients, so each step equals one step on the whole
global batch: the result does not depend on the number of ranks.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("KERAS_BACKEND", "torch")  # must be set before keras is imported

import keras  # noqa: E402
import numpy as np  # noqa: E402

import hvdlike.keras as hvd  # noqa: E402


def load_digits(train_size: int = 1400):
    """Digits scaled to [0, 1], shuffled with a fixed seed, split train/test."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    order = np.random.default_rng(0).permutation(len(data.target))
    x = (data.data[order] / 16.0).astype(np.float32)
    y = data.target[order].astype(np.int32)
    return (x[:train_size], y[:train_size]), (x[train_size:], y[train_size:])


def shard(x, y, batch: int, rank: int, size: int):
    """This rank's slice of every full global batch, in order."""
    steps = len(x) // batch
    local = batch // size

    def take(a):
        a = a[:steps * batch].reshape((steps, size, local) + a.shape[1:])
        return a[:, rank].reshape((steps * local,) + a.shape[3:])

    return take(x), take(y)


def build_model(seed: int) -> keras.Model:
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                             keras.layers.Dense(10)])


def compile_model(model, optimizer) -> None:
    model.compile(optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])


def train(epochs: int = 3, batch: int = 64, lr: float = 0.1, seed: int = 0, verbose: int = 0):
    """Train; return final weights, the (rank-averaged) history and test accuracy."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if batch % size:
        raise ValueError(f"--batch {batch} must divide evenly across {size} ranks")
    (x_train, y_train), (x_test, y_test) = load_digits()
    x_mine, y_mine = shard(x_train, y_train, batch, rank, size)

    # Different initial weights on every rank on purpose: the broadcast
    # callback makes rank 0's the starting point everywhere.
    model = build_model(seed + rank)
    compile_model(model, hvd.DistributedOptimizer(keras.optimizers.SGD(lr, momentum=0.9)))
    history = model.fit(
        x_mine, y_mine, batch_size=batch // size, epochs=epochs, shuffle=False,
        verbose=verbose if rank == 0 else 0,
        callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(root_rank=0),
                   hvd.callbacks.MetricAverageCallback()])
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    return {"rank": rank, "accuracy": float(accuracy), "history": history.history,
            "weights": [np.asarray(w) for w in model.get_weights()]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    result = train(args.epochs, args.batch, args.lr, verbose=2)
    if result["rank"] == 0:
        print(f"backend {keras.backend.backend()}: test accuracy {result['accuracy']:.4f}, "
              f"final epoch loss {result['history']['loss'][-1]:.4f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
