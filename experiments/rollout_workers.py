"""Rollout workers: the prompts of a rollout shared out among processes that read the policy's weights in place.

Why. On a CPU, a decode step of a small MoE is bound by the cost of each operator call and by Python, which a second
intra-op thread hardly shortens: the bench-tiny rollout takes 0.87 s on one thread and 0.77 s on two, while two
processes of one thread, each sampling half of the prompts, take 0.61 s together. `trainer.rollout_workers=W`
therefore samples with W processes of `threads / W` threads each: this one and W - 1 helpers. Training keeps all
the threads in this process (its matmuls are large enough to use them).

How. The policy's parameters and buffers move to shared memory once (`Module.share_memory`); each helper builds
the same model from the same config and points its parameters at those shared tensors, so the optimizer's in-place
updates are what the helpers sample from at the next rollout: nothing is copied per step. A rollout deals the
prompts out in contiguous chunks (whole groups); helpers send back the token ids, the sampled tokens' log-probs and
the recorded routing, and the chunks are stacked in prompt order: the layout one `generate` call produces.

Randomness. Helper i seeds its own generator from the run's seed and i at start, so a run is reproducible for a
given number of workers; it differs from a one-worker run only in the random numbers each prompt draws.

CPU only (a GPU wants one large batch, not processes). Like DataLoader workers, helpers are spawned processes: a
script that builds a trainer with `rollout_workers > 1` needs the usual `if __name__ == "__main__":` guard.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from dataclasses import asdict
from typing import Iterator

import torch
import torch.multiprocessing as mp
from transformers import PreTrainedModel

from experiments.rollout import Samples, concat_samples, sample_groups
from models.policy import ModelConfig, build_policy

# Helper i draws from seed + i * SEED_STRIDE: streams of different workers and of nearby run seeds never coincide.
SEED_STRIDE = 1_000_003


def shared_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by name, tied ones under each of their names (storage shared)."""
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return {name: tensor.detach() for name, tensor in named.items()}


def alias_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Point every parameter and buffer of `model` at the tensor of the same name (no copy)."""
    own = shared_tensors(model)
    if own.keys() != tensors.keys():
        missing, extra = sorted(own.keys() - tensors.keys()), sorted(tensors.keys() - own.keys())
        raise ValueError(f"rollout worker's model differs from the policy: missing {missing[:3]}, extra {extra[:3]}")
    for name, tensor in tensors.items():
        if own[name].shape != tensor.shape or own[name].dtype != tensor.dtype:
            raise ValueError(
                f"rollout worker's {name} is {tuple(own[name].shape)} {own[name].dtype}, the policy's "
                f"{tuple(tensor.shape)} {tensor.dtype}"
            )
        owner_name, _, attribute = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        if attribute in owner._parameters:
            owner._parameters[attribute] = torch.nn.Parameter(tensor, requires_grad=False)
        else:
            owner._buffers[attribute] = tensor


def _serve(connection, model_config: dict, tensors: dict[str, torch.Tensor], threads: int, seed: int) -> None:
    """A helper's life: build the policy on the shared weights, then sample each chunk it is sent until `None`."""
    try:
        torch.set_num_threads(threads)
        torch.manual_seed(seed)
        model, _ = build_policy(ModelConfig(**model_config))
        alias_tensors(model, tensors)
        model.eval()
        connection.send(("ready", None))
    except Exception:
        connection.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            job = connection.recv()
        except EOFError:  # the trainer is gone
            return
        if job is None:
            return
        try:
            connection.send(("ok", sample_groups(model, *job)))
        except Exception:
            connection.send(("error", traceback.format_exc()))


class RolloutWorkers:
    """`workers` samplers for `model`'s rollouts: this process and `workers - 1` helper processes."""

    def __init__(self, model: PreTrainedModel, model_config: ModelConfig, workers: int, threads: int, seed: int):
        if workers < 2:
            raise ValueError(f"RolloutWorkers needs workers >= 2, got {workers}; sample in-process instead")
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("rollout workers share the weights in CPU memory; on a GPU sample in-process")
        self.model = model
        self.size = workers
        self.threads_each = max(1, threads // workers)
        model.share_memory()
        tensors = shared_tensors(model)
        context = mp.get_context("spawn")
        self.connections, self.processes = [], []
        for index in range(1, workers):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(theirs, asdict(model_config), tensors, self.threads_each, seed + index * SEED_STRIDE),
                daemon=True,
                name=f"rollout-worker-{index}",
            )
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)
        self._ready = False
        self._finalizer = weakref.finalize(self, _shut_down, self.connections, self.processes)

    def sample(
        self, prompts: dict[str, torch.Tensor], group_size: int, options: dict, temperature: float, record: bool
    ) -> Samples:
        """`sample_groups` over all prompts, each worker taking a contiguous chunk of them; same layout."""
        if not self._ready:
            for reply in [self._receive(index) for index in range(len(self.connections))]:
                _raise_failure(reply)
            self._ready = True
        chunks = [
            {key: value[rows] for key, value in prompts.items()}
            for rows in torch.arange(prompts["input_ids"].shape[0]).tensor_split(self.size)
            if len(rows)
        ]
        for connection, chunk in zip(self.connections, chunks[1:]):
            connection.send((chunk, group_size, options, temperature, record))
        try:
            with _threads(self.threads_each):
                local = sample_groups(self.model, chunks[0], group_size, options, temperature, record)
        finally:
            # Every helper that was sent a chunk answers before anything is raised: a reply left in a pipe would
            # be read as the answer to the next rollout.
            replies = [self._receive(index) for index in range(len(chunks) - 1)]
        for reply in replies:
            _raise_failure(reply)
        return concat_samples([local, *(payload for _, _, payload in replies)], options["pad_token_id"])

    def _receive(self, index: int) -> tuple[int, str, object]:
        """(worker number, status, payload) of helper `index`'s next reply; a dead helper reads as a failure."""
        try:
            status, payload = self.connections[index].recv()
        except EOFError:
            self.processes[index].join(timeout=1)
            status, payload = "error", f"exited with code {self.processes[index].exitcode}"
        return index + 1, status, payload

    def close(self) -> None:
        """Stop the helpers (also done when this object is collected)."""
        self._finalizer()


def _raise_failure(reply: tuple[int, str, object]) -> None:
    """Raise the failure a helper reported (its last line first, then its traceback, which is otherwise lost)."""
    worker, status, payload = reply
    if status == "error":
        last_line = payload.strip().splitlines()[-1]
        raise RuntimeError(f"rollout worker {worker} failed: {last_line}\n{payload}")


def _shut_down(connections: list, processes: list) -> None:
    for connection in connections:
        with contextlib.suppress(OSError):
            connection.send(None)
    for process in processes:
        process.join(timeout=5)
        if process.is_alive():
            process.terminate()
    for connection in connections:
        connection.close()


@contextlib.contextmanager
def _threads(count: int) -> Iterator[None]:
    """Run the block on `count` intra-op threads, then restore the previous count."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
