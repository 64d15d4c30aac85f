"""Train the small Llama that the CacheBlend benchmark measures quality on (CPU, minutes).

Why this file exists: random weights say nothing about blending quality, and no model can
be downloaded here. This script trains a ~3.4M-parameter Llama on text every CPython ships
(pydoc topics), cut into chunks that continue each other across `<sep>` and carry
synthetic retrieval facts (benchmarks/blend/blend_task.py), on sequences shaped like the
benchmark's RAG prompts.

It is seeded (torch and the data order) and caches the weights and the tokenizer outside
the repository, under ~/.cache/lmcached/bench/<key>/, where <key> hashes the corpus, the
model config, the training settings, the number of steps and the seed; a second run loads
them, `--force` retrains. `--minutes` caps the wall-clock time: a run stopped by it keeps
fewer steps than its key says (logged, and kept in meta.json as steps_done). At the end it
prints the accuracy on held-out prompts under a full prefill (continuation tokens, and
1-hop / 2-hop facts), so a reader knows what the model learnt.

    .venv/bin/python -m benchmarks.blend.train_blend_model            # 600 steps, 20 min cap
    .venv/bin/python -m benchmarks.blend.train_blend_model --threads 1 # on a loaded machine
"""

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from benchmarks.blend.blend_task import VOCAB_SIZE, BlendTask, corpus_digest, train_tokenizer

CACHE_ROOT = os.path.join(os.path.expanduser("~"), ".cache", "lmcached", "bench")
FORMAT_VERSION = 2  # bump when the task or the training loop changes what a key means

# The model of the research brief (section 6): 4 layers, hidden 256, GQA 8/4 heads.
MODEL_CONFIG = dict(vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=672,
                    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                    max_position_embeddings=8192, rope_theta=10000.0,
                    tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
# Llama 3's frequency-dependent RoPE scaling, to exercise the re-rotation of scaled RoPE.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
TRAIN_DEFAULTS = dict(batch_size=8, lr=2e-3, warmup_steps=50, weight_decay=0.1,
                      answer_weight=2.0, questions_per_sequence=6)


def model_config(rope: str = "default"):
    """The LlamaConfig trained here; rope "llama3" adds Llama 3 RoPE scaling."""
    from transformers import LlamaConfig

    if rope not in ("default", "llama3"):
        raise ValueError(f"rope must be 'default' or 'llama3', got {rope!r}")
    extra = {"rope_scaling": dict(LLAMA3_ROPE, rope_theta=MODEL_CONFIG["rope_theta"])} \
        if rope == "llama3" else {}
    return LlamaConfig(**MODEL_CONFIG, **extra)


def cache_key(steps: int, seed: int, rope: str) -> str:
    """First 16 hex digits of sha256 over everything that determines the trained weights."""
    spec = {"format": FORMAT_VERSION, "corpus": corpus_digest(), "model": MODEL_CONFIG,
            "rope": rope, "train": TRAIN_DEFAULTS, "steps": steps, "seed": seed,
            "torch": torch.__version__.split("+")[0]}
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def make_batch(task: BlendTask, rng: random.Random, batch_size: int, questions: int,
               split: str = "train") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`batch_size` training sequences, right-padded with <eos>.

    Returns:
        (ids int64 [B, T], labels int64 [B, T] (-100 on padding), is_answer bool [B, T])
        where labels[:, t] is the token at t + 1.
    """
    examples = [task.training_example(rng, split, questions) for _ in range(batch_size)]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((batch_size, width), task.eos_id, dtype=torch.int64)
    labels = torch.full((batch_size, width), -100, dtype=torch.int64)
    is_answer = torch.zeros((batch_size, width), dtype=torch.bool)
    for row, (seq, answer) in enumerate(examples):
        n = len(seq)
        ids[row, :n] = torch.tensor(seq)
        labels[row, :n - 1] = torch.tensor(seq[1:])
        is_answer[row, :n - 1] = torch.tensor(answer[1:], dtype=torch.bool)
    return ids, labels, is_answer


@torch.inference_mode()
def answer_accuracy(model, task: BlendTask, num_prompts: int, seed: int) -> dict:
    """Accuracy of a full prefill on held-out prompts (teacher-forced), by prompt kind.

    "continue": fraction of continuation tokens that are the argmax; "1_hop" / "2_hop":
    fraction of fact prompts whose two values are both the argmax.

    Returns:
        `{"continue": fraction, "1_hop": fraction, "2_hop": fraction, "num_prompts": n}`.
    """
    rng = random.Random(seed)
    scores = {"continue": [], "1_hop": [], "2_hop": []}
    while sum(map(len, scores.values())) < num_prompts:
        prompts = task.prompts(rng, task.chunks(rng, 12, "held_out"), 4)
        for prompt in prompts:
            ids = torch.tensor([prompt.input_ids + prompt.answer_ids[:-1]])
            logits = model(ids, logits_to_keep=len(prompt.answer_ids)).logits[0]
            hit = logits.argmax(-1)[:prompt.num_scored] == torch.tensor(
                prompt.answer_ids[:prompt.num_scored])
            if prompt.kind == "continue":
                scores["continue"] += hit.tolist()
            else:
                scores[f"{prompt.hops}_hop"].append(bool(hit.all()))
    out = {k: sum(v) / max(1, len(v)) for k, v in scores.items()}
    return dict(out, num_prompts=num_prompts)


def train(task: BlendTask, steps: int, minutes: float, seed: int, rope: str,
          log_every: int) -> tuple[object, dict]:
    """Train from scratch (AdamW, warm-up then cosine to 10%); stops early at `minutes`.

    Returns:
        (model in eval mode, log dict: steps_done, final losses, tokens, seconds).
    """
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    rng = random.Random(seed)
    model = LlamaForCausalLM(model_config(rope))
    cfg = TRAIN_DEFAULTS
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg["weight_decay"]},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=cfg["lr"], betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < cfg["warmup_steps"]:
            return cfg["lr"] * (step + 1) / cfg["warmup_steps"]
        progress = (step - cfg["warmup_steps"]) / max(1, steps - cfg["warmup_steps"])
        return cfg["lr"] * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))

    num_params = sum(p.numel() for p in model.parameters())
    print(f"training {num_params / 1e6:.2f}M params, {steps} steps of {cfg['batch_size']} "
          f"sequences, {torch.get_num_threads()} threads, cap {minutes:g} min", flush=True)
    model.train()
    started = window_start = time.perf_counter()
    tokens = window_tokens = 0
    loss_sum = answer_sum = 0.0
    step = 0
    for step in range(steps):
        ids, labels, is_answer = make_batch(task, rng, cfg["batch_size"],
                                            cfg["questions_per_sequence"])
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        logits = model(ids).logits
        per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none",
                                    ignore_index=-100).view_as(labels)
        valid = labels != -100
        lm_loss = per_token[valid].mean()
        answer_loss = per_token[is_answer].mean()
        loss = lm_loss + cfg["answer_weight"] * answer_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        n = int(valid.sum())
        tokens += n
        window_tokens += n
        loss_sum += lm_loss.item()
        answer_sum += answer_loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            now = time.perf_counter()
            count = (step % log_every) + 1
            print(f"step {step + 1:5d}/{steps}  loss {loss_sum / count:.3f}  answer loss "
                  f"{answer_sum / count:.3f}  lr {lr_at(step):.2e}  "
                  f"{window_tokens / (now - window_start):,.0f} tok/s  {now - started:.0f} s",
                  flush=True)
            final = {"lm_loss": loss_sum / count, "answer_loss": answer_sum / count}
            loss_sum = answer_sum = 0.0
            window_start, window_tokens = now, 0
        if time.perf_counter() - started > minutes * 60:
            print(f"time cap of {minutes:g} min reached after {step + 1} steps: stopping "
                  "early (these weights depend on the machine's speed)", flush=True)
            break
    model.eval()
    log = {"steps": steps, "steps_done": step + 1, "tokens": tokens,
           "seconds": time.perf_counter() - started, "num_params": num_params,
           "threads": torch.get_num_threads(), **final}
    return model, log


def load_or_train(steps: int = 600, minutes: float = 20.0, seed: int = 0, rope: str = "default",
                  force: bool = False, log_every: int = 50, eval_prompts: int = 200):
    """The trained model, its tokenizer's task and training metadata, from the cache or new.

    Args:
        steps: optimizer steps (the schedule and the cache key depend on it).
        minutes: wall-clock cap; stopping early is logged in the metadata.
        seed: seeds torch (init, dropout-free) and the data order.
        rope: "default" or "llama3" (Llama 3 RoPE scaling).
        force: retrain even when cached.

    Returns:
        (model (eval, fp32, cpu), BlendTask, meta dict with "cache_dir", "train", "accuracy").
    """
    from tokenizers import Tokenizer
    from transformers import LlamaForCausalLM

    key = cache_key(steps, seed, rope)
    cache_dir = os.path.join(CACHE_ROOT, key)
    meta_path = os.path.join(cache_dir, "meta.json")
    if not force and os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        task = BlendTask(Tokenizer.from_file(os.path.join(cache_dir, "tokenizer.json")))
        model = LlamaForCausalLM.from_pretrained(cache_dir).eval()
        return model, task, dict(meta, cache_dir=cache_dir, cached=True)
    random.seed(seed)
    tokenizer = train_tokenizer()
    task = BlendTask(tokenizer)
    print(f"corpus: {task.num_text_tokens('train'):,} training / "
          f"{task.num_text_tokens('held_out'):,} held-out pydoc tokens", flush=True)
    model, log = train(task, steps, minutes, seed, rope, log_every)
    accuracy = answer_accuracy(model, task, eval_prompts, seed + 1)
    meta = {"key": key, "rope": rope, "seed": seed, "model": MODEL_CONFIG, "train": log,
            "train_settings": TRAIN_DEFAULTS, "accuracy": accuracy}
    os.makedirs(CACHE_ROOT, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{key}-", dir=CACHE_ROOT)
    model.save_pretrained(staging)
    tokenizer.save(os.path.join(staging, "tokenizer.json"))
    with open(os.path.join(staging, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1)
    shutil.rmtree(cache_dir, ignore_errors=True)
    os.rename(staging, cache_dir)  # readers see a complete directory or none
    return model, task, dict(meta, cache_dir=cache_dir, cached=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=600,
                        help="optimizer steps of 8 sequences (default 600; part of the cache key)")
    parser.add_argument("--minutes", type=float, default=20.0,
                        help="wall-clock cap; stopping early makes the weights machine-dependent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rope", choices=("default", "llama3"), default="default")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    parser.add_argument("--log-every", type=int, default=50, help="progress line every N steps")
    parser.add_argument("--force", action="store_true", help="retrain even when cached")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, task, meta = load_or_train(args.steps, args.minutes, args.seed, args.rope, args.force,
                                      args.log_every)
    log, accuracy = meta["train"], meta["accuracy"]
    print(f"{'loaded' if meta['cached'] else 'saved'} {meta['cache_dir']}")
    print(f"final loss {log['lm_loss']:.3f} (answer tokens {log['answer_loss']:.3f}) after "
          f"{log['steps_done']} steps, {log['tokens']:,} tokens, {log['seconds']:.0f} s")
    print(f"held-out accuracy, full prefill ({accuracy['num_prompts']} prompts): continuation "
          f"tokens {accuracy['continue']:.1%}, fact 1-hop {accuracy['1_hop']:.1%}, 2-hop "
          f"{accuracy['2_hop']:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
