"""DPO batches for the tests, built straight from tokenized text (not through data/), and
a Ray-free DPO run on them: in this process (`run_engine`) or under torchrun

    python -m torch.distributed.run --nproc-per-node 2 tests/dpo_pairs.py CONFIG PAIRS OUT [CHECKPOINTS]

(`CONFIG` a job YAML, `PAIRS` a `torch.save`d ``{"train": pairs, "val": pairs}``, `OUT` the
metrics JSON rank 0 writes, `CHECKPOINTS` where checkpoints go, ``step_N``, when due).

The pairs are real text: the prompt asks what a standard-library function does, the
chosen answer is its docstring's first paragraph and the rejected one the same words
shuffled, so the two responses have the same tokens in another order.
"""

from __future__ import annotations

import inspect
import json
import random
import sys
from pathlib import Path

import torch

_FUNCTIONS = ("json.dumps", "json.loads", "os.path.join", "os.path.splitext", "shutil.copytree", "shutil.rmtree",
              "textwrap.dedent", "textwrap.wrap", "random.shuffle", "random.choice", "math.isclose", "math.comb",
              "itertools.islice", "functools.partial", "functools.reduce", "collections.namedtuple",
              "heapq.heappush", "heapq.merge", "bisect.insort", "base64.b64encode", "zlib.compress",
              "glob.glob", "fnmatch.fnmatch", "difflib.unified_diff", "copy.deepcopy", "string.capwords",
              "urllib.parse.urlsplit", "urllib.parse.quote", "csv.reader", "tempfile.mkdtemp", "statistics.median",
              "operator.attrgetter")


def _answer(dotted: str) -> str:
    import importlib

    module, _, name = dotted.rpartition(".")
    doc = inspect.getdoc(getattr(importlib.import_module(module), name)) or ""
    return " ".join(doc.split("\n\n")[0].split())


def text_pairs(n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """`n` (prompt, chosen, rejected): a docstring paragraph and its words shuffled."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        dotted = _FUNCTIONS[i % len(_FUNCTIONS)]
        chosen = _answer(dotted)
        words = chosen.split()
        rng.shuffle(words)
        out.append((f"What does `{dotted}` do?\n", chosen, " ".join(words)))
    return out


def pair_tensors(tokenizer, pairs: list[tuple[str, str, str]], length: int) -> dict[str, torch.Tensor]:
    """The batch contract of models/preference.py for `pairs`: rows of `length` tokens,
    prompt then response then EOS, right-padded; the mask is 1 on the response and EOS."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    out: dict[str, list] = {"chosen_tokens": [], "rejected_tokens": [], "chosen_mask": [], "rejected_mask": []}
    for prompt, chosen, rejected in pairs:
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for side, text in (("chosen", chosen), ("rejected", rejected)):
            r = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
            ids = (p + r)[:length]
            mask = ([0] * len(p) + [1] * len(r))[:length]
            assert sum(mask) > 0, "the prompt leaves room for a response"
            out[f"{side}_tokens"].append(ids + [pad] * (length - len(ids)))
            out[f"{side}_mask"].append(mask + [0] * (length - len(mask)))
    batch = {k: torch.tensor(v, dtype=torch.uint8 if k.endswith("mask") else torch.int64) for k, v in out.items()}
    batch["sample_id"] = torch.arange(len(pairs), dtype=torch.int64)
    return batch


def take(pairs: dict[str, torch.Tensor], rows) -> dict[str, torch.Tensor]:
    """The rows `rows` (a slice or index tensor) of every tensor of `pairs`."""
    return {k: v[rows] for k, v in pairs.items()}


class FixedPairs:
    """A `BatchSource` over fixed pairs: each optimizer step takes the next
    ``dp x micro x accum`` pairs, cut into micro-batches dealt round-robin to the
    data-parallel ranks, so every layout's step holds the same pairs. Validation: the
    `val` pairs, dealt alike."""

    def __init__(self, train: dict[str, torch.Tensor], val: dict[str, torch.Tensor] | None, *, rank: int, dp: int,
                 micro: int, accum: int):
        self.train, self.val, self.rank, self.dp, self.micro, self.accum = train, val, rank, dp, micro, accum

    def _deal(self, pairs: dict[str, torch.Tensor], micro_steps: int):
        for m in range(micro_steps):
            start = (m * self.dp + self.rank) * self.micro
            yield take(pairs, slice(start, start + self.micro))

    def train_epoch(self, epoch: int):
        n = self.train["sample_id"].numel() // (self.dp * self.micro)
        return self._deal(self.train, n)

    def val_batches(self, n: int):
        assert self.val is not None
        return list(self._deal(self.val, min(n, self.val["sample_id"].numel() // (self.dp * self.micro))))


class Rows:
    """A `Reporter` keeping every report's metrics; checkpoints go under `checkpoints`
    (``step_N``) when given, else none is written."""

    def __init__(self, checkpoints: str | None = None):
        self.rows: list[dict] = []
        self.checkpoints = checkpoints

    def report(self, metrics: dict, save) -> None:
        self.rows.append(dict(metrics))
        if save is not None and self.checkpoints is not None:
            save(str(Path(self.checkpoints) / f"step_{metrics['step']}"))


def run_engine(cfg, pairs: dict[str, torch.Tensor], val: dict[str, torch.Tensor] | None = None, *,
               env=None, checkpoints: str | None = None, resume: str | None = None,
               engine_hook=None) -> list[dict]:
    """Train the job config `cfg` (a `JobConfig`) with the engine on `pairs` (Ray-free,
    this process's rank of torchrun's group, if any), from the checkpoint `resume` if
    given; `engine_hook(engine)` sees the engine before it trains. Returns its metrics rows."""
    from raytrain_platform.core.dist import init_torchrun
    from raytrain_platform.core.engine import Engine
    from raytrain_platform.data.sources import DataInfo
    from raytrain_platform.parallel.dims import ParallelDims
    from raytrain_platform.resolve import ResolvedJob

    env = env or init_torchrun(use_gpu=False)
    dims = ParallelDims.from_config(cfg)
    micro, accum = cfg.data.micro_batch, cfg.train.grad_accum_steps
    n = pairs["sample_id"].numel()
    steps = n // (dims.dp * micro * accum)
    job = ResolvedJob(config=cfg, data=DataInfo(num_train=n, num_val=0 if val is None else val["sample_id"].numel()),
                      steps_per_epoch=steps, total_steps=cfg.train.max_steps or steps)
    engine = Engine(job, env, resuming=resume is not None)
    if resume is not None:
        engine.restore(resume)
    if engine_hook is not None:
        engine_hook(engine)
    reporter = Rows(checkpoints)
    engine.fit(FixedPairs(pairs, val, rank=dims.data_rank(env.rank), dp=dims.dp, micro=micro, accum=accum), reporter)
    return reporter.rows


def main(argv: list[str]) -> int:
    from raytrain_platform.config import load_config
    from raytrain_platform.core.dist import init_torchrun

    config, pairs_path, out, *checkpoints = argv
    torch.set_num_threads(1)
    env = init_torchrun(use_gpu=False)
    pairs = torch.load(pairs_path, weights_only=True)
    cfg = load_config(config, [f"scaling.num_workers={env.world_size}"])
    rows = run_engine(cfg, pairs["train"], pairs.get("val"), env=env, checkpoints=next(iter(checkpoints), None))
    if env.is_rank0:
        Path(out).write_text(json.dumps(rows))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main(sys.argv[1:]))
