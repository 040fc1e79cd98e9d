"""`ringtrain bench step --baseline torch`: the presets' CNN written in PyTorch.

The model is written out by hand (``cnn``, ``cnn2``; PyTorch cannot read a Keras config), then
given ringtrain's starting weights in PyTorch's layouts, so both sides start alike; the loss on
ringtrain's first batch (``start_loss``) shows they do. It runs in the bench's own process:
``torch.set_num_threads`` may change at any time, unlike TensorFlow's pools
(:mod:`ringtrain_bench.baseline_tf`). This module is the only one that imports torch.
"""

from __future__ import annotations

import time

import numpy as np

from ringtrain.errors import InvalidSpec


class TorchSide:
    """The same model and step in PyTorch (CPU, float32, Adam with Keras' epsilon), in this
    process (``torch.set_num_threads`` may change at any time, unlike TensorFlow's pools)."""

    name = "torch"

    def __init__(self, args, threads: int, ipu=None):
        import torch
        from torch import nn

        if args.model not in ("cnn", "cnn2"):
            raise InvalidSpec(
                f"--model {args.model}: the PyTorch side has only the presets "
                "cnn and cnn2; add --no-torch (--baseline tensorflow runs any Keras model)"
            )
        torch.set_num_threads(threads)
        torch.manual_seed(0)
        self.torch = torch
        layers = [nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2)]
        flat, hwc = 13 * 13 * 32, (13, 13, 32)
        if args.model == "cnn2":
            layers += [nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2)]
            flat, hwc = 5 * 5 * 64, (5, 5, 64)
        layers += [nn.Flatten(), nn.Linear(flat, 64), nn.ReLU(), nn.Linear(64, 10)]
        self.model = nn.Sequential(*layers)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3, eps=1e-7)
        self.loss = nn.CrossEntropyLoss()
        g = torch.Generator().manual_seed(0)
        n = max(8192, 4 * args.batch_size)
        self.x = torch.rand(n, 1, 28, 28, generator=g)
        self.y = torch.randint(0, 10, (n,), generator=g)
        self.batch, self.n, self.pos = args.batch_size, n, 0
        self.version = torch.__version__
        self.start_loss: float | None = None
        if ipu is not None:
            self._start_from(ipu, hwc)

    def _start_from(self, ipu, hwc: tuple[int, int, int]) -> None:
        """ringtrain's starting weights (Keras layout: HWIO kernels, (in, out) matrices, an
        HWC flatten) in PyTorch's (OIHW, (out, in), CHW), and their loss on its first batch."""
        torch, trainer = self.torch, ipu.trainer
        arrays = iter(trainer.spec.keras_weights(trainer.params, trainer.ipu.state))
        first_dense = True
        with torch.no_grad():
            for m in self.model:
                if not isinstance(m, torch.nn.Conv2d | torch.nn.Linear):  # the weighted layers
                    continue
                k, b = next(arrays), next(arrays)
                if k.ndim == 4:
                    k = k.transpose(3, 2, 0, 1)
                elif first_dense:
                    k = k.reshape(*hwc, -1).transpose(3, 2, 0, 1).reshape(k.shape[1], -1)
                    first_dense = False
                else:
                    k = k.T
                m.weight.copy_(torch.from_numpy(np.ascontiguousarray(k)))
                m.bias.copy_(torch.from_numpy(b))
            x0, y0 = ipu.first_batch()
            x0 = torch.from_numpy(x0.reshape(len(y0), 1, 28, 28))
            self.start_loss = float(self.loss(self.model(x0), torch.from_numpy(y0)))
        self.loss_first: float | None = None
        self.loss_last: float | None = None
        self.cpu_seconds = 0.0  # the last run()'s CPU time, every thread of its process

    def run(self, steps: int) -> float:
        if steps < 1:
            return 0.0
        torch = self.torch
        t, c = time.perf_counter(), time.process_time()
        for _ in range(steps):
            if self.pos + self.batch > self.n:
                self.pos = 0
            idx = torch.arange(self.pos, self.pos + self.batch)
            self.pos += self.batch
            xb, yb = self.x[idx], self.y[idx]
            self.opt.zero_grad(set_to_none=True)
            loss = self.loss(self.model(xb), yb)
            loss.backward()
            self.opt.step()
        dt = time.perf_counter() - t
        self.cpu_seconds = time.process_time() - c
        self.loss_last = float(loss.detach())
        if self.loss_first is None:
            self.loss_first = self.loss_last
        return dt

    def close(self):
        pass
