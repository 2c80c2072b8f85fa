"""Data-parallel training of a small MLP on scikit-learn's digits, with JAX and optax.

Run on two ranks (or one, for comparison)::

    hvdlike-run -np 2 python examples/jax_digits.py
    python examples/jax_digits.py

Every step takes one global batch of ``--batch`` examples; each rank computes
gradients on its own slice of it, and ``hvd.DistributedOptimizer`` averages
them inside the jitted step. The averaged gradient is the gradient of the
whole batch, so N ranks follow the same trajectory as one process -- the
printed accuracy is the same (up to float rounding) whatever the rank count.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import hvdlike.jax as hvd


def load_digits(train_size: int = 1400):
    """Digits scaled to [0, 1], shuffled with a fixed seed, split train/test."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(x))
    x, y = x[order], y[order]
    return (x[:train_size], y[:train_size]), (x[train_size:], y[train_size:])


def init_params(key, sizes=(64, 32, 10)):
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        key, sub = jax.random.split(key)
        params.append({"w": jax.random.normal(sub, (fan_in, fan_out)) / jnp.sqrt(fan_in),
                       "b": jnp.zeros(fan_out)})
    return params


def predict(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_fn(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(predict(params, x), y).mean()


def train(steps: int = 120, batch: int = 64, lr: float = 0.1, momentum: float = 0.9,
          seed: int = 0):
    """Train and return ``{"accuracy", "loss", "params"}`` (params as numpy arrays)."""
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if batch % size:
        raise ValueError(f"--batch {batch} must divide evenly across {size} ranks")
    (x_train, y_train), (x_test, y_test) = load_digits()

    # Each rank starts from different random weights on purpose: the broadcast
    # is what makes them identical.
    params = hvd.broadcast_pytree(init_params(jax.random.key(seed + 1000 * rank)), root_rank=0)
    tx = hvd.DistributedOptimizer(optax.sgd(lr, momentum=momentum))
    opt_state = hvd.broadcast_pytree(tx.init(params), root_rank=0)

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    local = batch // size
    losses = []
    for i in range(steps):
        start = (i * batch) % (len(x_train) - batch + 1)
        mine = slice(start + rank * local, start + (rank + 1) * local)
        params, opt_state, loss = step(params, opt_state, x_train[mine], y_train[mine])
        losses.append(float(loss))
    # The global loss of the last step: the average of the ranks' local losses.
    last = float(hvd.allreduce(jnp.asarray(losses[-1]), name="last_loss"))
    accuracy = float((predict(params, x_test).argmax(-1) == y_test).mean())
    result = {"accuracy": accuracy, "loss": last, "rank": rank,
              "params": jax.tree.map(np.asarray, params)}
    hvd.shutdown()
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()
    result = train(args.steps, args.batch, args.lr)
    if result["rank"] == 0:
        print(f"test accuracy {result['accuracy']:.4f}, final batch loss {result['loss']:.4f}")


if __name__ == "__main__":
    main()
