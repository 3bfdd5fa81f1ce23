"""A recorder for ``model/step_capture.py`` that keeps CUDA graphs' contract without a GPU.

A CUDA graph, once recorded, replays the same kernels into the same memory: its outputs are fixed tensors
that each replay rewrites. ``RerunRecorder`` does that on any device: ``record`` runs the function once and
keeps its result; a replay runs the function again and copies the new values into the kept tensors. So the
capture's plumbing runs for real on CPU (the fixed input, output and gradient memory, the one autograd node,
``.grad`` written by the backward or handed to autograd, DeepSpeed's hooks and optimizer over it), while the
recording itself, which needs a GPU, is checked by ``tests/engine/test_cuda_graphs.py`` there.
"""

from __future__ import annotations

import torch


class RerunRecorder:
    def __init__(self):
        self.replays = 0

    def warm_up(self, fn) -> None:
        fn()

    def record(self, fn):
        result = fn()

        def replay() -> None:
            # A replay reruns what was recorded, which was recorded with grad on: the forward inside an autograd
            # Function (grad off) must still build the graph its backward replay differentiates.
            with torch.enable_grad():
                fresh = fn()
            for kept, new in zip(result, fresh):
                if kept is not None:
                    kept.copy_(new)
            self.replays += 1

        return result, replay
