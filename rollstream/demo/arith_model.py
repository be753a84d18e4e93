"""The demo's local model: a short supervised warm-up of the tiny model on worked arith
agent episodes, so that RL starts with rewards above zero. Episodes are tokenized the way the agent loop will see them:
the prompt through the chat template once, each assistant turn as its own tokens (loss on),
each observation as the template's delta (loss off). Built models are kept in a cache folder
named after their recipe (``cached_arith_model``), one builder at a time across processes."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from rollstream.agent.chat import ChatRenderer
from rollstream.agent.tools import submit_tool_schema
from rollstream.config import env_setting
from rollstream.llm.sequences import common_prefix_length
from rollstream.llm.tiny_model import build_tiny_model
from rollstream.llm.transformers_compat import cache_kwargs, output_cache
from rollstream.tasks import arith

log = logging.getLogger(__name__)


def episode_tokens(tokenizer, tools: list[dict], messages: list[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one episode, split at the same boundaries as a rollout."""
    chat = ChatRenderer(tokenizer, tools)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    ids = chat.prompt_ids(messages[:first])
    mask = [0] * len(ids)
    history = messages[:first]
    i = first
    while i < len(messages):
        assistant = messages[i]
        before = chat.render(history, add_generation_prompt=True)
        after = chat.render(history + [assistant], add_generation_prompt=False)
        turn = after[len(before):]
        cut = turn.find(chat.end_of_turn)
        turn_ids = chat.encode(turn[:cut + len(chat.end_of_turn)])
        ids += turn_ids
        mask += [1] * len(turn_ids)
        history = history + [assistant]
        j = i + 1
        observations = []
        while j < len(messages) and messages[j]["role"] != "assistant":
            observations.append(messages[j])
            j += 1
        if observations:
            obs = chat.observation_ids(history, observations, model_ended_turn=True)
            ids += obs
            mask += [0] * len(obs)
            history = history + observations
        i = j
    return ids, mask


def warm_up(model_dir: Path, episodes: list[list[dict]], tools: list[dict], out_dir: Path, *,
            steps: int = 300, batch_size: int = 16, lr: float = 3e-3, seed: int = 0,
            on_step: Callable[[int, int], None] | None = None) -> Path:
    """Train on the assistant tokens of ``episodes`` and save the model to ``out_dir``;
    ``on_step(done, steps)`` after each step (a progress bar)."""
    import torch  # heavy, optional (the model extra): importing this module must not load it

    # One intra-op thread: this model's matrices are too small to share, and on a loaded
    # 2-core machine two spin-waiting OpenMP threads made a step 14x slower (7.3 s vs 0.52 s).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _warm_up(model_dir, episodes, tools, out_dir, steps=steps, batch_size=batch_size, lr=lr, seed=seed,
                        on_step=on_step)
    finally:
        torch.set_num_threads(threads)


def _warm_up(model_dir: Path, episodes: list[list[dict]], tools: list[dict], out_dir: Path, *, steps: int,
             batch_size: int, lr: float, seed: int, on_step: Callable[[int, int], None] | None) -> Path:
    import torch  # heavy, optional (the model extra), as in warm_up
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    data = [episode_tokens(tokenizer, tools, ep) for ep in episodes]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20) * max(0.05, 1 - s / steps))
    # Every episode starts with the same system prompt and tool list; run that shared prefix
    # once per step without gradients and train only on what follows (5x less compute).
    prefix_len = min(common_prefix_length(data[0][0], ids) for ids, _ in data)
    prefix = torch.tensor(data[0][0][:prefix_len]).unsqueeze(0)
    model.train()
    for step in range(steps):
        with torch.no_grad():
            cache = output_cache(model(input_ids=prefix, use_cache=True))
        cache.batch_repeat_interleave(batch_size)
        batch = [data[rng.randrange(len(data))] for _ in range(batch_size)]
        width = max(len(ids) for ids, _ in batch) - prefix_len
        input_ids = torch.full((batch_size, width), pad, dtype=torch.long)
        labels = torch.full((batch_size, width), -100, dtype=torch.long)
        attention = torch.zeros((batch_size, prefix_len + width), dtype=torch.long)
        attention[:, :prefix_len] = 1
        for row, (ids, mask) in enumerate(batch):
            ids, mask = ids[prefix_len:], mask[prefix_len:]
            input_ids[row, :len(ids)] = torch.tensor(ids)
            attention[row, prefix_len:prefix_len + len(ids)] = 1
            labels[row, :len(ids)] = torch.tensor([t if m else -100 for t, m in zip(ids, mask)])
        loss = model(input_ids=input_ids, attention_mask=attention, labels=labels, **cache_kwargs(model, cache)).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step + 1, steps)
        if step % 50 == 0 or step == steps - 1:
            log.info("format warm-up step %d/%d loss %.4f", step + 1, steps, loss.item())
    model.eval()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


# The RL benchmark's model: warmed up on one-digit sums (high 5) in episodes that all
# compute with bash and copy its output into the answer, but of which only 25 % call submit
# with the argument its schema names (`answer`); the others call it `result`, which scores
# 0. It copies reliably and follows the schema about as often as it saw it (reward ~0.2 at
# temperature 1): what RL has to learn is to call the tool as its schema says, one choice
# early in the turn, which 15 DAPO steps learn (0.23 -> 0.88). What did not work, with
# two- and three-digit sums: a warm-up on right episodes only left RL nothing but digit
# copying to sharpen (reward flat at ~0.46 over 15 steps); mixing in episodes that guess,
# echo the expression unevaluated, or name the argument `result` taught the tiny model to
# add approximately from the question instead of copying the tool's output.
ARITH_RL_RECIPE: dict = {"steps": 500, "seed": 0, "episodes": 2000, "answer_copy_rate": 1.0,
                         "answer_key_rate": 0.25, "high": 5, "lr": 3e-3}


# The tests' model: the right format on sums up to 99, rarely the right answer.
FORMAT_RECIPE: dict = {"steps": 200, "seed": 0, "episodes": 1000, "answer_copy_rate": 1.0,
                       "answer_key_rate": 1.0, "high": 99, "lr": 3e-3}


def recipe_folder_name(recipe: dict, prefix: str = "arith-rl") -> str:
    """A cache folder name that changes with the recipe, so an edited recipe rebuilds."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:10]
    return f"{prefix}-{digest}"


def model_cache() -> Path:
    """Where built models are kept across runs: ROLLSTREAM_MODEL_CACHE, else ~/.cache/rollstream/models."""
    return Path(env_setting("MODEL_CACHE") or Path.home() / ".cache" / "rollstream" / "models")


@contextlib.contextmanager
def build_lock(folder: Path) -> Iterator[None]:
    """One builder of ``folder`` at a time across processes (test runs, demos, benchmarks
    started together on one machine wait for the first build instead of each redoing it)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_arith_model(recipe: dict = ARITH_RL_RECIPE, *, cache: Path | None = None, prefix: str = "arith-rl",
                       on_step: Callable[[int, int], None] | None = None) -> Path:
    """The arith model of ``recipe`` from the cache folder named after the recipe, built there
    first if missing (one builder at a time)."""
    out = Path(cache or model_cache()) / recipe_folder_name(recipe, prefix)
    if (out / "config.json").exists():
        return out
    with build_lock(out):
        return build_arith_model(out, on_step=on_step, **recipe)


def build_arith_model(out_dir: Path, *, steps: int = 200, seed: int = 0, episodes: int = 1000,
                      answer_copy_rate: float = 1.0, answer_key_rate: float = 1.0, high: int = 99,
                      lr: float = 3e-3, on_step: Callable[[int, int], None] | None = None) -> Path:
    """The tiny local model, warmed up on the arith toy task's format (cached by folder).

    The defaults (FORMAT_RECIPE) give the tests' model (right format, rarely the right answer).
    The RL recipe (ARITH_RL_RECIPE) trains longer on episodes that name the answer's argument
    as the schema says only part of the time, so that rewards start low but not at zero."""
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists():
        return out_dir
    base = build_tiny_model(out_dir.parent / f"{out_dir.name}-base", seed=seed)
    tools = [arith.BASH_SCHEMA, submit_tool_schema("submit")]
    eps = arith.conversations(arith.make_instances(episodes, seed=seed + 1, high=high),
                              answer_copy_rate=answer_copy_rate, answer_key_rate=answer_key_rate, seed=seed + 2)
    # a private temporary folder, renamed into place: a concurrent builder never sees half a model
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        warm_up(base, eps, tools, tmp, steps=steps, seed=seed, lr=lr, on_step=on_step)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():  # not another builder's finished model
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
