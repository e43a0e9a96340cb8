"""Generation side of the GRPO recipe: rollouts from the engine, rewards, batches.

The engine (:class:`nemo_dcr.integrations.vllm.engine.VllmEngine` or
:class:`nemo_dcr.integrations.hf.engine.HFEngine`) holds bf16 weights that the refit keeps
bit-identical to the trainer's.  Each step samples ``group_size`` answers per
arithmetic prompt with the chat template (reusing :mod:`nemo_dcr.tools.demo.task`),
scores them with the exact-answer reward, and turns them into a right-padded token batch with
per-label weights (the group-relative advantage on answer tokens) for the Megatron trainer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from nemo_dcr.tools.demo.task import (
    RLConfig,
    exact_reward,
    group_advantages,
    make_problems,
    pad_left,
    prompt_ids,
    sample,
    shaped_reward,
)


@dataclass(frozen=True)
class RolloutBatch:
    """One step's rollouts as a training batch.

    Attributes:
        tokens: ``[B, L+1]`` prompt + answer token ids, right-padded with end-of-turn.
        weights: ``[B, L]`` advantage of each label ``tokens[:, 1:]`` (0 off the answers).
        reward_mean: mean exact (0/1) reward.
        shaped_reward_mean: mean shaped reward (exact + partial credit).
        version: engine weight version that produced the rollouts.
        texts: the decoded answers.
    """

    tokens: torch.Tensor
    weights: torch.Tensor
    reward_mean: float
    shaped_reward_mean: float
    version: int
    texts: list[str]


def rl_config(task, engine, seed: int) -> RLConfig:
    """The :class:`RLConfig` of a recipe's ``task`` and ``engine`` blocks."""
    return RLConfig(seed=seed, group_size=task.group_size, prompts_per_step=task.prompts_per_step,
                    max_new_tokens=engine.max_new_tokens, temperature=engine.temperature,
                    partial_credit=task.partial_credit)


def to_batch(seqs: torch.Tensor, prompt_len: int, full_mask: torch.Tensor,
             answer_mask: torch.Tensor, adv: torch.Tensor, pad_id: int):
    """Left-padded ``generate`` output -> right-padded tokens and label weights.

    Args:
        seqs: ``[B, P+T]`` prompts (left-padded to ``prompt_len``) followed by answers.
        prompt_len: ``P``.
        full_mask: ``[B, P+T]`` attention mask (1 on real prompt and answer tokens).
        answer_mask: ``[B, T]`` 1 on answer tokens up to and including the end of turn.
        adv: ``[B]`` advantage of each sequence.
        pad_id: padding token.
    """
    rows, spans = [], []
    for i in range(seqs.shape[0]):
        prompt = seqs[i, :prompt_len][full_mask[i, :prompt_len] == 1]
        answer = seqs[i, prompt_len:][answer_mask[i] == 1]
        rows.append(torch.cat([prompt, answer]))
        spans.append((prompt.numel(), answer.numel()))
    width = max(r.numel() for r in rows)
    tokens = torch.full((len(rows), width), pad_id, dtype=torch.long)
    weights = torch.zeros(len(rows), width - 1)
    for i, (row, (p, a)) in enumerate(zip(rows, spans)):
        tokens[i, : row.numel()] = row
        weights[i, p - 1 : p - 1 + a] = float(adv[i])  # label j predicts token j + 1
    return tokens, weights


def sample_vllm(engine, tokenizer, problems, cfg: RLConfig, seed: int):
    """:func:`~nemo_dcr.tools.demo.task.sample` on a :class:`~nemo_dcr.integrations.vllm.engine.VllmEngine`:
    the same prompts, pure sampling, the same ``(ids, mask, answer_mask, texts)`` layout (answers
    padded with end-of-turn).  Call it under ``engine.serving()``."""
    import vllm
    from vllm.inputs import TokensPrompt

    eos = tokenizer.eos_token_id
    prompts = prompt_ids(tokenizer, problems)
    params = vllm.SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_k=-1, top_p=1.0,
                                 max_tokens=cfg.max_new_tokens, seed=seed)
    outs = engine.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    answers = [list(c.token_ids) for o in outs for c in o.outputs]
    width = max(len(a) for a in answers)
    ans = torch.full((len(answers), width), eos, dtype=torch.long)
    for i, a in enumerate(answers):
        ans[i, :len(a)] = torch.tensor(a, dtype=torch.long)
    ids, mask = pad_left(prompts, eos)
    is_eos = (ans == eos).long()
    answer_mask = ((is_eos.cumsum(dim=1) - is_eos) == 0).long()
    seqs = torch.cat([ids.repeat_interleave(cfg.group_size, dim=0), ans], dim=1)
    full_mask = torch.cat([mask.repeat_interleave(cfg.group_size, dim=0), answer_mask], dim=1)
    return seqs, full_mask, answer_mask, tokenizer.batch_decode(ans, skip_special_tokens=True)


def rollout(engine, tokenizer, rng: random.Random, cfg: RLConfig) -> RolloutBatch:
    """Sample, score and batch one GRPO step's rollouts from one engine version (a transformers
    :class:`~nemo_dcr.integrations.hf.engine.HFEngine` or a vLLM engine)."""
    problems = make_problems(rng, cfg.prompts_per_step)
    with engine.serving() as version:
        if hasattr(engine, "llm"):
            seqs, full_mask, answer_mask, texts = sample_vllm(engine, tokenizer, problems, cfg, rng.randrange(1 << 30))
        else:
            seqs, full_mask, answer_mask, texts = sample(engine.model, tokenizer, problems, cfg)
    answers = [p.answer for p in problems for _ in range(cfg.group_size)]
    exact = torch.tensor([exact_reward(t, a) for t, a in zip(texts, answers)])
    shaped = torch.tensor([shaped_reward(t, a, cfg.partial_credit) for t, a in zip(texts, answers)])
    adv = group_advantages(shaped.view(len(problems), cfg.group_size)).reshape(-1)
    prompt_len = seqs.shape[1] - answer_mask.shape[1]
    tokens, weights = to_batch(seqs, prompt_len, full_mask, answer_mask, adv,
                               tokenizer.eos_token_id)
    return RolloutBatch(tokens, weights, float(exact.mean()), float(shaped.mean()), version, texts)
