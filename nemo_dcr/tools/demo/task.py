"""Real RL weight deltas: a few GRPO-style AdamW steps on SmolLM2-135M-Instruct, on CPU.

The model in fp32 is the master copy; after every ``optimizer.step()`` its bf16 rounding is
written as an HF checkpoint directory ``step_k`` (``step_0`` = initial weights). Consecutive
directories differ exactly as a BF16 trainer's weights differ between refits, so codec and
apply tests run on real update statistics instead of synthetic noise.

Objective ``pg`` (default): per arithmetic prompt ("What is 7+5? Answer with just the
number.", operands 1..9 so the 135M model solves some) sample ``group_size`` answers with the
chat template; reward is 1 if the last integer of the answer is the exact result else 0 (the
model tends to restate the question, "7 + 5 = 12", so the first integer is the operand);
advantage = reward - group mean;
loss = -mean(advantage * sum log-prob of the sampled answer tokens).

Zero-gradient guard. If every answer in a group gets the same reward, that group contributes
no gradient, and if all groups do the step would be a silent no-op. Two measures:

1. Partial credit: a wrong answer earns ``partial_credit / (1 + |guess - answer|)`` when it
   contains an integer (0 without one), so groups rarely tie. ``reward_mean`` in the logs
   and ``meta.json`` is still the exact 0/1 reward.
2. Fallback: if all groups still tie, the step uses the ``lm`` objective on the same prompts
   (``meta.json`` records ``"fallback": true``). :func:`make_deltas` finally raises if a step
   left every bf16 element unchanged.

Objective ``lm``: next-token loss on prompt + correct answer (answer tokens only).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from nemo_dcr.checkpoint import save_checkpoint
from nemo_dcr.tools.megatron.bf16_products import bf16_products_in_fp32
from nemo_dcr.integrations.hf.model import load_embedded_model, load_embedded_tokenizer, state_dict_bits
from nemo_dcr.types import bits_view

ANSWER_RE = re.compile(r"-?\d+")


@dataclass(frozen=True)
class RLConfig:
    """Hyper-parameters of one delta-generating run."""

    lr: float = 1e-6
    """AdamW learning rate."""
    seed: int = 0
    """Seeds prompt choice and sampling (runs are reproducible on one machine)."""
    group_size: int = 8
    """Sampled answers per prompt (the GRPO group)."""
    prompts_per_step: int = 2
    """Prompts (groups) per optimizer step."""
    max_new_tokens: int = 8
    """Answer length cap; arithmetic answers need 1-3 tokens."""
    objective: str = "pg"
    """``pg`` (policy gradient) or ``lm`` (next-token loss on correct answers)."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    temperature: float = 1.0
    """Sampling temperature (pure sampling: no top-k/top-p)."""
    partial_credit: float = 0.1
    """Weight of the closeness reward given to wrong answers (see module doc)."""

    def __post_init__(self):
        if self.objective not in ("pg", "lm"):
            raise ValueError(f"objective must be 'pg' or 'lm', got {self.objective!r}")
        if self.group_size < 1 or self.prompts_per_step < 1 or self.max_new_tokens < 1:
            raise ValueError("group_size, prompts_per_step and max_new_tokens must be >= 1")


@dataclass(frozen=True)
class Problem:
    """One arithmetic prompt and its exact answer."""

    question: str
    answer: int


@dataclass(frozen=True)
class StepStats:
    """What one optimizer step did."""

    loss: float
    reward_mean: float
    """Mean exact (0/1) reward of the sampled answers (NaN for ``lm``)."""
    shaped_reward_mean: float
    fallback: bool
    """True if ``pg`` had no reward variance and used the ``lm`` loss instead."""


def make_problems(rng: random.Random, n: int) -> list[Problem]:
    """``n`` small addition/subtraction questions on single digits (measured exact-answer rate
    of the embedded model, last-integer rule, temperature 1: about 19%)."""
    out = []
    for _ in range(n):
        a, b, op = rng.randint(1, 9), rng.randint(1, 9), rng.choice("++-")
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        out.append(Problem(f"What is {a}{op}{b}? Answer with just the number.", value))
    return out


def exact_reward(text: str, answer: int) -> float:
    """1.0 if the last integer in ``text`` equals ``answer``, else 0.0."""
    found = ANSWER_RE.findall(text)
    return float(bool(found) and int(found[-1]) == answer)


def shaped_reward(text: str, answer: int, partial_credit: float) -> float:
    """Exact reward, plus ``partial_credit / (1 + |guess - answer|)`` for wrong integers."""
    found = ANSWER_RE.findall(text)
    if not found:
        return 0.0
    guess = int(found[-1])
    return 1.0 if guess == answer else partial_credit / (1.0 + abs(guess - answer))


def group_advantages(rewards: torch.Tensor) -> torch.Tensor:
    """Reward minus its group mean; ``rewards`` is ``[groups, group_size]``."""
    return rewards - rewards.mean(dim=1, keepdim=True)


def prompt_ids(tokenizer, problems: list[Problem]) -> list[list[int]]:
    """Chat-template token ids of each question, ending with the assistant turn header."""
    out = []
    for p in problems:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": p.question}], tokenize=False, add_generation_prompt=True
        )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def pad_left(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad to one length: ``(ids, attention_mask)``, both ``[len(seqs), max_len]``."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids, mask


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding (what ``generate`` uses)."""
    return (mask.cumsum(dim=1) - 1).clamp(min=0)


def sample(model, tokenizer, problems: list[Problem], cfg: RLConfig):
    """Sample ``group_size`` answers per problem.

    Returns:
        ``(ids, mask, answer_mask, texts)``: full sequences ``[P*G, L+T]`` and their attention
        mask, the mask of answer tokens (up to and including the first end-of-turn) ``[P*G, T]``,
        and the decoded answers.
    """
    eos = tokenizer.eos_token_id
    ids, mask = pad_left(prompt_ids(tokenizer, problems), eos)
    with torch.no_grad(), bf16_products_in_fp32(model.device):
        seqs = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=cfg.temperature,
            top_k=0, top_p=1.0, max_new_tokens=cfg.max_new_tokens,
            num_return_sequences=cfg.group_size, pad_token_id=eos,
        )  # fmt: skip
    answers = seqs[:, ids.shape[1] :]
    is_eos = (answers == eos).long()
    answer_mask = ((is_eos.cumsum(dim=1) - is_eos) == 0).long()
    full_mask = torch.cat([mask.repeat_interleave(cfg.group_size, dim=0), answer_mask], dim=1)
    texts = tokenizer.batch_decode(answers, skip_special_tokens=True)
    return seqs, full_mask, answer_mask, texts


def answer_logprobs(model, seqs, mask, answer_mask) -> torch.Tensor:
    """Sum of log-probabilities of each sequence's answer tokens, ``[B]``, with grad."""
    n = answer_mask.shape[1]
    out = model(
        input_ids=seqs, attention_mask=mask, position_ids=positions(mask),
        logits_to_keep=n + 1, use_cache=False,
    )  # fmt: skip
    logp = torch.log_softmax(out.logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, seqs[:, -n:].unsqueeze(-1)).squeeze(-1)
    return (tok * answer_mask).sum(dim=1)


def lm_loss(model, tokenizer, problems: list[Problem]) -> torch.Tensor:
    """Mean next-token loss of the correct answers (plus end-of-turn) given the prompts."""
    eos = tokenizer.eos_token_id
    seqs, n_answer = [], []
    for p, ids in zip(problems, prompt_ids(tokenizer, problems)):
        ans = tokenizer(str(p.answer), add_special_tokens=False)["input_ids"] + [eos]
        seqs.append(ids + ans)
        n_answer.append(len(ans))
    ids, mask = pad_left(seqs, eos)
    labels = torch.full_like(ids, -100)
    for i, n in enumerate(n_answer):
        labels[i, -n:] = ids[i, -n:]
    return model(
        input_ids=ids, attention_mask=mask, position_ids=positions(mask), labels=labels,
        use_cache=False,
    ).loss  # fmt: skip


def pg_loss(model, tokenizer, problems: list[Problem], cfg: RLConfig):
    """GRPO-style loss (see module doc); falls back to :func:`lm_loss` on zero variance."""
    seqs, mask, answer_mask, texts = sample(model, tokenizer, problems, cfg)
    answers = [p.answer for p in problems for _ in range(cfg.group_size)]
    exact = torch.tensor([exact_reward(t, a) for t, a in zip(texts, answers)])
    shaped = torch.tensor([shaped_reward(t, a, cfg.partial_credit) for t, a in zip(texts, answers)])
    adv = group_advantages(shaped.view(len(problems), cfg.group_size)).reshape(-1)
    fallback = bool((adv == 0).all())
    if fallback:
        loss = lm_loss(model, tokenizer, problems)
    else:
        loss = -(adv * answer_logprobs(model, seqs, mask, answer_mask)).mean()
    stats = StepStats(float(loss.detach()), float(exact.mean()), float(shaped.mean()), fallback)
    return loss, stats


def train_step(model, optimizer, tokenizer, problems: list[Problem], cfg: RLConfig) -> StepStats:
    """One AdamW step on ``problems`` with ``cfg.objective``; updates the fp32 masters."""
    if cfg.objective == "pg":
        loss, stats = pg_loss(model, tokenizer, problems, cfg)
    else:
        loss = lm_loss(model, tokenizer, problems)
        stats = StepStats(float(loss.detach()), float("nan"), float("nan"), False)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    return stats


def make_optimizer(model, cfg: RLConfig) -> torch.optim.AdamW:
    """``torch.optim.AdamW`` over all parameters with ``cfg``'s lr, betas and weight decay."""
    return torch.optim.AdamW(
        model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay
    )


def count_changed(prev: dict[str, torch.Tensor], cur: dict[str, torch.Tensor]) -> tuple[int, int]:
    """``(changed elements, total elements)`` between two state dicts, by bit comparison."""
    changed = total = 0
    for name, t in cur.items():
        changed += int(np.count_nonzero(bits_view(prev[name]) != bits_view(t)))
        total += t.numel()
    return changed, total


def write_step(out_dir: Path, step: int, bits: dict[str, torch.Tensor], meta: dict, config) -> Path:
    """Write ``out_dir/step_<step>``: ``model.safetensors``, ``meta.json``, ``config.json``."""
    step_dir = Path(out_dir) / f"step_{step}"
    save_checkpoint(bits, step_dir, metadata={"format": "pt", "step": str(step)})
    (step_dir / "meta.json").write_text(json.dumps({"step": step, **meta}, indent=2) + "\n")
    if config is not None:
        cfg = json.loads(config.to_json_string())
        cfg["dtype"] = "bfloat16"
        cfg.pop("quantization_config", None)  # GGUF origin; these weights are plain bf16
        (step_dir / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return step_dir


def make_deltas(
    out_dir: str | Path,
    steps: int,
    lr: float = 1e-6,
    *,
    log: Callable[[str], object] = print,
    model=None,
    tokenizer=None,
    **options,
) -> list[Path]:
    """Run ``steps`` AdamW steps and write ``out_dir/step_0 .. step_<steps>`` (bf16 weights).

    The step folders are written into a staging folder inside ``out_dir`` and moved into place
    (replacing step folders of the same names) only once every step succeeded: a failure leaves
    no step folder and no staging folder (and no ``out_dir`` when it did not exist before).

    Args:
        out_dir: output folder (created).
        steps: number of optimizer steps; ``steps + 1`` checkpoints are written.
        lr: AdamW learning rate.
        log: progress sink, one line per step.
        model: fp32 SmolLM2 to train in place (default: load the embedded one).
        tokenizer: its tokenizer (default: load the embedded one).
        **options: further :class:`RLConfig` fields (seed, group_size, prompts_per_step,
            max_new_tokens, objective, weight_decay, ...).

    Returns:
        The step directories, ``step_0`` first.

    Raises:
        RuntimeError: a step left every bf16 element unchanged.
    """
    cfg = RLConfig(lr=lr, **options)
    t0 = time.perf_counter()
    model = load_embedded_model(torch.float32) if model is None else model
    tokenizer = load_embedded_tokenizer() if tokenizer is None else tokenizer
    log(f"loaded model and tokenizer in {time.perf_counter() - t0:.1f}s")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    optimizer = make_optimizer(model, cfg)
    base = {**asdict(cfg), "betas": list(cfg.betas)}
    prev = state_dict_bits(model)
    config = getattr(model, "config", None)
    with _staged(Path(out_dir)) as stage:
        write_step(stage, 0, prev, {**base, "density": None}, config)
        for step in range(1, steps + 1):
            t = time.perf_counter()
            problems = make_problems(rng, cfg.prompts_per_step)
            stats = train_step(model, optimizer, tokenizer, problems, cfg)
            cur = state_dict_bits(model)
            meta = {"step": step, **base, **asdict(stats), **_density(prev, cur, step, cfg.lr)}
            meta["seconds"] = round(time.perf_counter() - t, 2)
            write_step(stage, step, cur, meta, config)
            log(_progress_line(meta))
            prev = cur
    return [Path(out_dir) / f"step_{k}" for k in range(steps + 1)]


@contextmanager
def _staged(out_dir: Path) -> Iterator[Path]:
    """A staging folder in ``out_dir`` whose ``step_*`` folders move into ``out_dir`` on success;
    on failure it is removed (with ``out_dir`` if this call created it)."""
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(dir=out_dir, prefix=".make-deltas-", suffix=".tmp"))
    try:
        yield stage
        for step_dir in sorted(stage.iterdir()):
            final = out_dir / step_dir.name
            if final.exists():
                shutil.rmtree(final)
            os.replace(step_dir, final)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        if created and not any(out_dir.iterdir()):
            out_dir.rmdir()


def _density(prev: dict, cur: dict, step: int, lr: float) -> dict:
    """``changed``/``numel``/``density`` of a step; raises if nothing changed."""
    changed, total = count_changed(prev, cur)
    if changed == 0:
        raise RuntimeError(f"step {step} changed no bf16 element (lr {lr} too small?)")
    return {"changed": changed, "numel": total, "density": changed / total}


def _progress_line(meta: dict) -> str:
    fallback = " [pg had no reward variance: lm fallback]" if meta["fallback"] else ""
    return (
        f"step {meta['step']}: reward {meta['reward_mean']:.3f} "
        f"loss {meta['loss']:+.4f} density {meta['density']:.4%} "
        f"({meta['changed']}/{meta['numel']}) {meta['seconds']:.1f}s{fallback}"
    )
