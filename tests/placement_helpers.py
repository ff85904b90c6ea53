"""The memory plan's inputs at paper scale (tests/engine/test_placement.py, tests/engine/test_recompute_stats.py): an
architecture's target and draft shapes, and the work of a prompt."""
from tforce.engine import placement
from tforce.bench.suite import LLAMA_68M
from tforce.config import Speculation
from tforce.model.synthetic import make_config


def shapes(arch: str, world: int = 1):
    draft = make_config(arch, rope_scaling=None, **LLAMA_68M)
    return placement.Shape.of(make_config(arch), 2, world), placement.Shape.of(draft, 2)


def work(prompt: int, gen: int = 256) -> placement.Work:
    spec = Speculation()
    return placement.Work(prompt + gen + spec.max_lookahead + 1, prompt, spec)
