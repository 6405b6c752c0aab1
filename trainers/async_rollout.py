"""One-step off-policy training on two processes (``trainer.async_rollout: true``), as verl's one-step-off-policy
recipe, AReaL and PipelineRL do: one process generates the episodes of step k+1 while the other trains on step k.

    accelerate launch --num_processes 2 trainers/ppo.py --config ... --set trainer.async_rollout=true
    torchrun --nproc_per_node 2 trainers/ppo.py ... --set trainer.async_rollout=true      # CPU: gloo

Rank 0 trains (`trainers.ppo`'s loop, with `RemoteRollouts` as its source of episodes); rank 1 generates (`serve`),
executing the trainer's commands in order — weights, play, evaluate, stop — on its own copy of the policy.
Everything between the two goes through `Link`: objects encoded by `mt_env.wire` over send/recv, and the weights as
one broadcast per parameter tensor. Every batch is one update old; after each transfer the trainer checks the
generator's weight checksum. The timeline, the order of sends, checkpoints and failures: docs/processes.md
("One-step off-policy").
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from agents.rollout import RolloutResult
from mt_env import wire

from .config import Config, ConfigError
from .setup import TaskSource
from .stopping import StopRequested

TRAINER, GENERATOR = 0, 1  #: the ranks
_LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


# --------------------------------------------------------------------------------------------- messages
@dataclass
class Weights:
    """The trainer's weights after `version` steps follow, one broadcast per parameter tensor."""

    version: int


@dataclass
class Play:
    step: int
    tasks: list[dict]
    n: int


@dataclass
class Evaluate:
    tasks: list[dict]
    step: int


@dataclass
class Stop:
    pass


@dataclass
class Played:
    step: int
    version: int  #: the weights that generated it
    checksum: int  #: `weights_checksum` of the generator's weights
    result: RolloutResult
    generate_s: float


@dataclass
class Evaluated:
    version: int
    checksum: int
    result: RolloutResult


@dataclass
class Failed:
    error: str  #: the generator's traceback


@dataclass
class Stopped:
    pass


class GeneratorError(RuntimeError):
    """The generator process failed; the message holds its traceback."""


# --------------------------------------------------------------------------------------------- the link
class Link:
    """This process's end of the two-process group (see the module docstring)."""

    def __init__(self, rank: int):
        self.rank = rank
        self.peer = 1 - rank

    @property
    def trains(self) -> bool:
        return self.rank == TRAINER

    def send(self, message) -> None:
        dist.send_object_list([wire.dumps(message)], dst=self.peer)  # its samples encoded compactly

    def receive(self):
        box = [None]
        dist.recv_object_list(box, src=self.peer)
        return wire.loads(box[0])

    def send_weights(self, module: nn.Module) -> None:
        for tensor in _weights(module):
            dist.broadcast(tensor, src=self.rank)

    def receive_weights(self, module: nn.Module) -> None:
        with torch.no_grad():
            for tensor in _weights(module):
                dist.broadcast(tensor, src=self.peer)

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        dist.destroy_process_group()


def open_link(cfg: Config) -> Link:
    """Join the two processes started by the launcher, then make each a one-process run for accelerate (its device
    named by ``ACCELERATE_TORCH_DEVICE``)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 2:
        raise ConfigError(f"trainer.async_rollout needs exactly 2 processes, one training and one generating, got "
                          f"{world}: launch with `accelerate launch --num_processes 2 trainers/ppo.py ...` (or "
                          f"`torchrun --nproc_per_node 2`)")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    cuda = cfg.device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=timedelta(seconds=cfg.trainer.async_timeout_s))
    for name in _LAUNCHER_VARIABLES:
        os.environ.pop(name, None)
    os.environ["ACCELERATE_TORCH_DEVICE"] = f"cuda:{local_rank}" if cuda else "cpu"
    return Link(rank)


def _weights(module: nn.Module) -> list[torch.Tensor]:
    """The tensors that go from the trainer to the generator: every parameter (tied ones once). Buffers are fixed at
    construction (rotary frequencies) and are not sent."""
    return [p.data for p in module.parameters()]


def weights_checksum(module: nn.Module) -> int:
    """An exact, order-independent fingerprint of the parameters' bits: the sum of their raw bits read as integers,
    in int64 (integer sums wrap the same way in any order, so the same bits give the same number on any device),
    read from the device once."""
    as_int = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    sums = [t.detach().contiguous().view(as_int[t.element_size()]).sum(dtype=torch.int64) for t in _weights(module)]
    return int(torch.stack(sums).sum())


# --------------------------------------------------------------------------------------------- the trainer's side
class RemoteRollouts:
    """The trainer's source of episodes in async mode: the generator process plays them (see the module docstring).

    `tasks` is the run's task stream: when the loop has drawn step k's tasks, the next `len(tasks)` are step k+1's,
    which the generator starts on before the trainer trains on step k."""

    def __init__(self, link: Link, lm: nn.Module, tasks: TaskSource, total_steps: int):
        self.link = link
        self.lm = lm
        self.tasks = tasks
        self.total_steps = total_steps
        self.version: int | None = None  #: the weight version the generator holds
        self.checksums: dict[int, int] = {}  #: of every weight version sent
        self.in_flight: int | None = None  #: the step the generator is playing
        self.ready: Played | None = None  #: a batch received early (before an evaluation)

    def play(self, tasks: list[dict], n: int, step: int) -> RolloutResult:
        if self.in_flight is None and self.ready is None:  # the first step of this session
            self._push_weights(step - 1)
            self._ask(Play(step, tasks, n))
        played, self.ready = self.ready or self._receive(Played), None
        if played.step != step:
            raise RuntimeError(f"async rollout: the trainer is at step {step} but the generator played step "
                               f"{played.step}")
        self._push_weights(step - 1)  # what the next step is played with
        if step < self.total_steps:
            self._ask(Play(step + 1, self.tasks.peek(len(tasks)), n))
        staleness = float(step - 1 - played.version)
        played.result.metrics.update({
            "async/staleness_mean": staleness, "async/staleness_max": staleness,
            "async/weights_version": float(played.version), "async/generate_s": played.generate_s})
        return played.result

    def evaluate(self, tasks: list[dict], step: int) -> RolloutResult:
        """On the generator, with the weights of `step` (this process's)."""
        if self.in_flight is not None:
            self.ready = self._receive(Played)
        self._push_weights(step)
        self.link.send(Evaluate(tasks, step))
        return self._receive(Evaluated).result

    def after_update(self) -> str:
        return "broadcast to the generator process before it plays the next step"

    def close(self) -> None:
        """Discard a batch in flight (the resumed run plays its step again) and stop the generator."""
        if self.in_flight is not None:
            self._receive(Played)
        self.link.send(Stop())
        self._receive(Stopped)
        self.link.close()

    def _ask(self, play: Play) -> None:
        self.link.send(play)
        self.in_flight = play.step

    def _push_weights(self, version: int) -> None:
        if self.version == version:
            return
        self.link.send(Weights(version))
        self.link.send_weights(self.lm)
        self.checksums[version] = weights_checksum(self.lm)
        self.version = version

    def _receive(self, kind: type):
        reply = self.link.receive()
        if isinstance(reply, Failed):
            raise GeneratorError(f"the generator process failed:\n{reply.error}")
        if not isinstance(reply, kind):
            raise RuntimeError(f"async rollout: expected {kind.__name__} from the generator, got {reply!r:.200}")
        if isinstance(reply, Played):
            self.in_flight = None
        if isinstance(reply, (Played, Evaluated)) and reply.checksum != self.checksums[reply.version]:
            raise RuntimeError(f"async rollout: the generator's weights of version {reply.version} differ from the "
                               f"trainer's (checksum {reply.checksum} != {self.checksums[reply.version]})")
        return reply


# --------------------------------------------------------------------------------------------- the generator's side
def serve(rollouts, link: Link, lm: nn.Module) -> dict:
    """The generator process: execute the trainer's commands in order until it says stop; returns a summary.
    `rollouts` plays on `lm` (`trainers.rollouts.LocalRollouts`)."""
    version, checksum, played = -1, 0, 0
    with StopRequested(announce=False):  # the first Ctrl-C is the trainer's to act on
        while not isinstance(command := link.receive(), Stop):
            if isinstance(command, Weights):
                link.receive_weights(lm)
                version, checksum = command.version, weights_checksum(lm)
                continue
            start = time.perf_counter()
            try:
                if isinstance(command, Play):
                    result = rollouts.play(command.tasks, command.n, command.step)
                    reply = Played(command.step, version, checksum, result, time.perf_counter() - start)
                    played += 1
                elif isinstance(command, Evaluate):
                    reply = Evaluated(version, checksum, rollouts.evaluate(command.tasks, command.step))
                else:
                    raise TypeError(f"unknown command {command!r:.200}")
            except Exception:
                link.send(Failed(traceback.format_exc()))
                raise
            link.send(reply)
    link.send(Stopped())
    rollouts.close()
    link.close()
    return {"role": "generator", "steps_played": played}
