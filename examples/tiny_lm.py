"""A tiny word-level "language model world" for the PPO demo: vocabulary, corpus, model,
pre-training, sampling and a programmatic sentiment reward.

Everything here is plain PyTorch + transformers; nothing in this file uses ppo_kernels.
It exists so that ``ppo_demo.py`` can stay focused on the RLHF loop itself.

The world
---------
Sentences are short reviews built from a small grammar::

    <bos> the NOUN VERB [INTENSIFIER] ADJ ( CONJ the NOUN VERB [INTENSIFIER] ADJ ){0,2} . <eos>

Adjectives are positive, negative or neutral. The corpus has a little semantics that the
model must learn: after ``and`` the next clause mostly keeps the sentiment of the previous
one (or turns neutral), after ``but`` it flips (positive <-> negative). The first clause's
sentiment is uniform, so a model trained on the corpus writes positive and negative
reviews equally often.

A prompt is the first four tokens ``<bos> the NOUN VERB``; the policy writes the rest.
The reward (``sentiment_score``) plays the part of a sentiment classifier: #positive minus
#negative adjectives, capped at MAX_SCORE = 3 (three positive clauses), and 1 less when the
review is cut off without <eos>. The pre-trained policy scores about 0 on average. To
score 3, PPO must learn several things at once: pick positive adjectives, follow a
positive clause with ``and`` rather than ``but``, and write the rarer three-clause
reviews, all within the corpus' grammar. The grammar is not part of the reward; the KL
leash to the reference is what keeps it. Without the cap, piling up adjectives
("great lovely nice superb ...") would pay more than the KL penalty costs and the KL would
run away (try ``MAX_SCORE = 99`` with a small ``--kl-coef``).
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

import torch
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

# --------------------------------------------------------------------------- vocabulary
PAD, BOS, EOS = "<pad>", "<bos>", "<eos>"
NOUNS = ["film", "food", "hotel", "staff", "music", "service", "book", "game", "room",
         "trip", "show", "coffee"]
VERBS = ["was", "seemed", "felt"]
INTENSIFIERS = ["very", "really", "quite", "rather", "so"]
POSITIVE = ["great", "good", "lovely", "wonderful", "amazing", "fun", "friendly", "nice",
            "superb", "charming"]
NEGATIVE = ["bad", "awful", "boring", "terrible", "rude", "dull", "poor", "bland", "noisy",
            "sad"]
NEUTRAL = ["long", "short", "quiet", "new", "old", "big", "small", "busy", "cheap", "simple"]
CONJUNCTIONS = ["and", "but"]
SENTIMENT = {**{w: 1 for w in POSITIVE}, **{w: -1 for w in NEGATIVE},
             **{w: 0 for w in NEUTRAL}}

PROMPT_LEN = 4          # <bos> the NOUN VERB
MAX_CLAUSES = 3         # the corpus never has more; longer text is out of distribution
MAX_SCORE = 3           # the reward saturates here (three positive clauses)
# Longest corpus response: "very great" + 2 x "and the food was very nice" + ". <eos>"
MAX_RESPONSE_LEN = 2 + (MAX_CLAUSES - 1) * 6 + 2


class Vocab:
    """Word <-> id tables. Ids 0, 1, 2 are <pad>, <bos>, <eos>."""

    def __init__(self):
        words = [PAD, BOS, EOS, "the", "."] + NOUNS + VERBS + INTENSIFIERS + POSITIVE \
            + NEGATIVE + NEUTRAL + CONJUNCTIONS
        assert len(set(words)) == len(words), "duplicate word in the vocabulary"
        self.itos = words
        self.stoi = {w: i for i, w in enumerate(words)}
        self.pad_id, self.bos_id, self.eos_id = 0, 1, 2

    def __len__(self):
        return len(self.itos)

    def encode(self, words: list[str]) -> list[int]:
        return [self.stoi[w] for w in words]

    def decode(self, ids, skip_special: bool = True) -> str:
        specials = {self.pad_id, self.bos_id, self.eos_id}
        return " ".join(self.itos[int(i)] for i in ids
                        if not (skip_special and int(i) in specials))


# ----------------------------------------------------------------------------- corpus
def _adjective(rng: random.Random, sentiment: int) -> str:
    return rng.choice({1: POSITIVE, -1: NEGATIVE, 0: NEUTRAL}[sentiment])


def _clause(rng: random.Random, sentiment: int) -> list[str]:
    words = ["the", rng.choice(NOUNS), rng.choice(VERBS)]
    if rng.random() < 0.3:
        words.append(rng.choice(INTENSIFIERS))
    return words + [_adjective(rng, sentiment)]


def make_sentence(rng: random.Random) -> list[str]:
    """One corpus review as a list of words, <bos> ... <eos> included.

    Clause count 1/2/3 with probability 0.4/0.4/0.2; ``and`` mostly keeps the previous clause's
    sentiment, ``but`` flips it (a neutral clause may be followed by anything)."""
    n_clauses = rng.choices([1, 2, 3], weights=[0.4, 0.4, 0.2])[0]
    sentiment = rng.choice([1, -1, 0])
    words = [BOS] + _clause(rng, sentiment)
    for _ in range(n_clauses - 1):
        conj = rng.choice(CONJUNCTIONS)
        if sentiment == 0:
            sentiment = rng.choice([1, -1, 0])
        elif conj == "and":
            sentiment = rng.choice([sentiment, sentiment, 0])   # mostly keep it
        else:
            sentiment = -sentiment
        words += [conj] + _clause(rng, sentiment)
    return words + [".", EOS]


def make_prompts(vocab: Vocab, n: int, rng: random.Random) -> torch.Tensor:
    """``n`` prompts ``<bos> the NOUN VERB`` as a [n, PROMPT_LEN] id tensor.

    All prompts have the same length, so generation needs no left padding."""
    return torch.tensor([vocab.encode([BOS, "the", rng.choice(NOUNS), rng.choice(VERBS)])
                         for _ in range(n)])


def batch_of_sentences(vocab: Vocab, n: int, rng: random.Random) -> torch.Tensor:
    """``n`` corpus sentences right-padded with <pad> into one [n, L] id tensor."""
    seqs = [vocab.encode(make_sentence(rng)) for _ in range(n)]
    width = max(map(len, seqs))
    return torch.tensor([s + [vocab.pad_id] * (width - len(s)) for s in seqs])


# ------------------------------------------------------------------------------ reward
def parse_response(words: list[str]) -> tuple[int, bool]:
    """(sentiment score, grammatical?) of a response given as words (<eos> excluded).

    The score is #positive - #negative adjectives, capped at MAX_SCORE. Grammatical means
    the response follows the corpus grammar, ``[INT] ADJ (CONJ the NOUN VERB [INT] ADJ)* .``
    with at most MAX_CLAUSES clauses; it is a diagnostic for "the text is still plausible", not part
    of the reward."""
    score = min(sum(SENTIMENT.get(w, 0) for w in words), MAX_SCORE)
    i, clauses, ok = 0, 0, True

    def take(options) -> bool:
        nonlocal i
        if i < len(words) and words[i] in options:
            i += 1
            return True
        return False

    while ok:
        take(INTENSIFIERS)
        ok = take(SENTIMENT)
        clauses += 1
        if not ok or take(["."]):
            break
        ok = take(CONJUNCTIONS) and take(["the"]) and take(NOUNS) and take(VERBS)
    ok = ok and i == len(words) and words[-1:] == ["."] and clauses <= MAX_CLAUSES
    return score, ok


def sentiment_score(vocab: Vocab, responses: torch.Tensor, lengths: torch.Tensor,
                    missing_eos_penalty: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [B] and a grammatical flag [B] for generated responses.

    ``responses`` [B, R] holds generated ids (<eos> then <pad> after the end), ``lengths`` [B]
    the number of generated tokens including <eos>. A response that never emitted <eos>
    (cut off at the length limit) loses ``missing_eos_penalty``, as TRL's
    ``missing_eos_penalty`` does: an unfinished review is not a review."""
    scores, valid = [], []
    for row, n in zip(responses.tolist(), lengths.tolist(), strict=True):
        row = row[:n]
        finished = bool(row) and row[-1] == vocab.eos_id
        words = [vocab.itos[t] for t in (row[:-1] if finished else row)]
        s, ok = parse_response(words)
        scores.append(s - (0.0 if finished else missing_eos_penalty))
        valid.append(ok and finished)
    return torch.tensor(scores, dtype=torch.float32), torch.tensor(valid)


# ------------------------------------------------------------------------------- model
@dataclass
class ModelConfig:
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    n_positions: int = 32


class PolicyWithValueHead(nn.Module):
    """A GPT-2 LM plus a scalar value head on its last hidden states (TRL's
    ``AutoModelForCausalLMWithValueHead`` layout: policy and critic share the trunk, so one
    forward pass gives both the logits and the values)."""

    def __init__(self, lm: GPT2LMHeadModel):
        super().__init__()
        self.lm = lm
        self.value_head = nn.Linear(lm.config.n_embd, 1)
        # Start the critic at V = 0 so the first advantages are just the returns, instead of
        # random noise that the value loss first has to unlearn.
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [B, L, V] (position t predicts token t + 1) and values [B, L] (the value of
        the state after reading tokens 0..t, i.e. before emitting token t + 1)."""
        out = self.lm(input_ids, output_hidden_states=True)
        # hidden_states[-1] is taken after GPT-2's final LayerNorm: the same features the LM
        # head reads.
        values = self.value_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, values

    def hidden_and_values(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The last hidden states [B, L, H] (after the final LayerNorm: what the LM head
        reads) and values [B, L], without the LM head: the caller applies it, e.g. inside
        ``pk.ppo_loss_from_hidden`` with ``lm_head_weight``, so that the [B, L, V] logits
        are never stored. ``forward``'s logits are ``hidden @ lm_head_weight.T``."""
        hidden = self.lm.transformer(input_ids).last_hidden_state
        return hidden, self.value_head(hidden).squeeze(-1)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight [V, H] (GPT-2 has no LM head bias). Tied to the input
        embedding: the gradient that reaches it through the head adds to the embedding's."""
        assert self.lm.lm_head.bias is None
        return self.lm.lm_head.weight


def build_lm(vocab: Vocab, cfg: ModelConfig) -> GPT2LMHeadModel:
    """A freshly initialised small GPT-2 with dropout off.

    Dropout must be off: PPO's first epoch assumes the training forward reproduces the
    rollout's log-probabilities exactly (ratio = 1), which dropout would break."""
    config = GPT2Config(vocab_size=len(vocab), n_positions=cfg.n_positions,
                        n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=vocab.bos_id, eos_token_id=vocab.eos_id,
                        pad_token_id=vocab.pad_id)
    return GPT2LMHeadModel(config)


def pretrain(lm: GPT2LMHeadModel, vocab: Vocab, rng: random.Random, steps: int,
             batch_size: int = 64, lr: float = 3e-3, progress=None) -> float:
    """Supervised pre-training ("SFT") on freshly generated corpus sentences.

    The corpus is generated on the fly, so there is no epoch and no overfitting. Returns
    the final training loss (nats per token)."""
    opt = torch.optim.AdamW(lm.parameters(), lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps,
                                                pct_start=0.1)
    lm.train()
    loss_ema = None
    for _ in range(steps):
        ids = batch_of_sentences(vocab, batch_size, rng).to(lm.device)
        labels = ids.masked_fill(ids == vocab.pad_id, -100)   # no loss on padding
        loss = lm(ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.9 * loss_ema + 0.1 * loss.item()
        if progress is not None:
            progress(loss_ema)
    lm.eval()
    return loss_ema


# ---------------------------------------------------------------------------- sampling
# transformers 5 renamed the KV-cache argument of forward() from past_key_values to cache.
_CACHE_ARG = ("cache" if "cache" in inspect.signature(GPT2LMHeadModel.forward).parameters
              else "past_key_values")


@torch.no_grad()
def generate(lm: GPT2LMHeadModel, prompts: torch.Tensor, max_new_tokens: int,
             temperature: float, eos_id: int, pad_id: int,
             generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Ancestral sampling from softmax(logits / temperature) with a KV cache.

    Returns the full sequences [B, P + R] (prompt, response, <pad> after <eos>; R is the
    longest response in the batch) and the response lengths [B] (<eos> included). A
    hand-written loop rather than ``lm.generate`` so that exactly the distribution PPO
    scores (same temperature, no top-k/top-p) is the one sampled from."""
    B = prompts.shape[0]
    logits_out = lm(prompts, use_cache=True)
    cache = getattr(logits_out, _CACHE_ARG)
    next_logits = logits_out.logits[:, -1]
    done = torch.zeros(B, dtype=torch.bool, device=prompts.device)
    lengths = torch.zeros(B, dtype=torch.long, device=prompts.device)
    out = []
    for _ in range(max_new_tokens):
        probs = torch.softmax(next_logits.float() / temperature, dim=-1)
        tok = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        out.append(tok)
        lengths += (~done).long()
        done |= tok == eos_id
        if bool(done.all()):
            break
        step = lm(tok.unsqueeze(1), use_cache=True, **{_CACHE_ARG: cache})
        cache = getattr(step, _CACHE_ARG)
        next_logits = step.logits[:, -1]
    return torch.cat([prompts, torch.stack(out, dim=1)], dim=1), lengths
