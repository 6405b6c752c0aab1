"""The embedded inference engine: paged KV with a prefix cache, continuous batching, CUDA-graph decode steps.

Cut by role: `config` (the knobs), `sequence` (a request's state), `blocks` (the KV block pool and prefix index),
`scheduler` (admission, decode plans, preemption, slots), `model_runner` (the device: KV pool, passes, CUDA graphs
via `graphs`), `layers` and `attention` (the forward functions), `sampler`, `layout` (the module's parts), `engine`
(the step loop), `transformers_runner` (the fallback for modules the layer loop does not serve). `HFBackend`
(`agents.hf_backend`) is the asyncio front. Design and measurements: docs/engine.md.
"""

from .config import EngineConfig
from .engine import Engine, new_stats
from .layout import UnsupportedModel, decoder_layout
from .sequence import Sequence

__all__ = ["Engine", "EngineConfig", "Sequence", "UnsupportedModel", "decoder_layout", "new_stats"]
