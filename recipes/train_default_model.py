#!/usr/bin/env python
"""Train hearth's default model: a small Llama on the Python standard library's own source code.

No weights can be downloaded where hearth runs, so hearth ships a model of its own, made by this
recipe from text every machine with Python has: the `.py` files of the running interpreter's
standard library. The recipe

1. lists the stdlib's .py files (sorted; no site-packages; none over 200 KB) and keeps ~2% of
   them out for evaluation, chosen by a hash of the relative path (the same files on every run);
   the stdlib's test suites stay in (61% of the bytes; --library-weight N repeats the library
   modules N times per pass instead);
2. makes chat examples from the training files: a function's docstring as the user's request,
   its source as the assistant's answer (so `hearth chat` has something it learned to do);
3. trains a byte-level BPE tokenizer (`tokenizers`) with `<|endoftext|>` (BOS, EOS, document
   separator), `<|im_start|>` and `<|im_end|>` (a ChatML chat template);
4. trains a `transformers` LlamaForCausalLM (tied embeddings, GQA) with plain PyTorch AdamW,
   bf16 autocast, cosine learning rate with warmup, on documents joined by `<|endoftext|>` and
   packed into fixed-length sequences; fixed seeds throughout;
5. saves the Hugging Face folder, the loss curve (PNG), a JSON record (settings, losses, times,
   held-out perplexity, samples) and converts the folder to GGUF with hearth's converter.

    python recipes/train_default_model.py --preset main --out out/default-main --minutes 35
    python recipes/train_default_model.py --preset draft --out out/default-draft --minutes 10 \
        --tokenizer out/default-main/hf

Steps 1 to 3 (the corpus, the tokenizer, the packed rows) are in recipes/stdlib_corpus.py beside this file.

Without --steps the number of optimizer steps is fitted to --minutes from the speed of the first
steps (the learning-rate schedule depends on the total, so it is fixed before warmup ends); the
JSON record gives the --steps that repeats the run exactly.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from types import SimpleNamespace

# steps 1 to 3 live beside this file; its folder on the path also where a test loads this file by path
sys.path.insert(0, str(Path(__file__).resolve().parent))
from stdlib_corpus import (  # noqa: E402  (the test of the recipe reads these through this module)
    EOT, IM_END, SPECIAL_TOKENS, chat_examples, hf_tokenizer, is_heldout, is_test_file, list_stdlib_files,
    load_tokenizer, pack_documents, read_texts, save_tokenizer, split_files, stdlib_root, train_tokenizer,
)

PRESETS = {
    # 5.40M parameters (1.05M of them the tied embedding); f16 GGUF 10.9 MB
    "main": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, lr=2e-3, minutes=35.0),
    # 1.25M parameters (4.3x fewer); same tokenizer, for speculative decoding; f16 GGUF 2.6 MB
    "draft": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, lr=3e-3, minutes=10.0),
}

# ---------------------------------------------------------------- training


def lr_at(step: int, total: int, peak: float, warmup: int, final_frac: float = 0.1) -> float:
    """Linear warmup over `warmup` steps, then cosine from peak down to final_frac * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (final_frac + (1 - final_frac) * 0.5 * (1 + math.cos(math.pi * progress)))


def heldout_nll(model, ids: list[int], context: int, max_windows: int | None = None) -> tuple[float, int]:
    """Mean NLL (nats) the way `hearth perplexity` measures it: non-overlapping windows of
    `context` tokens, every token after a window's first scored; float32, no autocast."""
    import torch
    import torch.nn.functional as F

    total, scored, windows = 0.0, 0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(ids) - 1, context):
            window = ids[start : start + context]
            if len(window) < 2 or (max_windows is not None and windows >= max_windows):
                break
            x = torch.tensor([window])
            logits = model(input_ids=x).logits[0, :-1].float()
            total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
            scored += len(window) - 1
            windows += 1
    model.train()
    return total / scored, scored


def plot_losses(record: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s for s, _ in record["train_loss"]]
    losses = [l for _, l in record["train_loss"]]
    tokens_per_step = record["settings"]["batch_size"] * record["settings"]["seq_len"]
    smooth, ema = [], None
    for l in losses:
        ema = l if ema is None else 0.95 * ema + 0.05 * l
        smooth.append(ema)
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    mtok = [s * tokens_per_step / 1e6 for s in steps]
    ax.plot(mtok, losses, color="tab:blue", alpha=0.25, lw=0.8, label="train (per step)")
    ax.plot(mtok, smooth, color="tab:blue", lw=1.6, label="train (EMA 0.95)")
    if record["eval_loss"]:
        es = [s * tokens_per_step / 1e6 for s, _ in record["eval_loss"]]
        ax.plot(es, [l for _, l in record["eval_loss"]], "o-", color="tab:orange", lw=1.4,
                label="held-out files (subset)")
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("cross-entropy (nats/token)")
    s = record["settings"]
    ax.set_title(f"hearth default model, preset {s['preset']}: {record['params'] / 1e6:.2f}M params, "
                 f"{record['train_seconds'] / 60:.1f} min, {s['threads']} thread(s)", fontsize=9.5)
    ax.set_ylim(bottom=max(0.0, min(losses) - 0.3), top=min(max(losses), 8.5) + 0.2)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


SAMPLE_PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef list_python_files(", "class Stack:\n"]
CHAT_PROMPT = "Return the greatest common divisor of two integers."


def samples(model, hf_tok, max_new_tokens: int = 80) -> list[dict]:
    import torch

    eos = [hf_tok.convert_tokens_to_ids(EOT), hf_tok.convert_tokens_to_ids(IM_END)]
    model.eval()
    out = []
    prompts = [(p, hf_tok(p, return_tensors="pt")["input_ids"]) for p in SAMPLE_PROMPTS]
    chat = hf_tok.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}], add_generation_prompt=True,
                                      tokenize=False)
    prompts.append((chat, hf_tok(chat, return_tensors="pt", add_special_tokens=True)["input_ids"]))
    with torch.no_grad():
        for text, ids in prompts:
            gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos[0])
            out.append({"prompt": text, "completion": hf_tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True)})
    model.train()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="main")
    ap.add_argument("--out", type=Path, required=True, help="output folder (HF model in OUT/hf, records, plot)")
    ap.add_argument("--minutes", type=float, default=None,
                    help="training time budget in minutes (default: the preset's); sets --steps if not given")
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps (default: fit to --minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch / tokenizers threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default: the preset's)")
    ap.add_argument("--warmup", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=None, help="steps between held-out evaluations")
    ap.add_argument("--library-weight", type=int, default=1,
                    help="times each library (non-test) file is repeated per pass over the data; test files once")
    ap.add_argument("--tokenizer", type=Path, default=None,
                    help="use this tokenizer folder instead of training one (the draft shares the main model's)")
    ap.add_argument("--gguf", type=Path, default=None, help="GGUF output path (default OUT/model-f16.gguf)")
    ap.add_argument("--gguf-type", default="f16", choices=["f32", "f16", "bf16", "q8_0"])
    ap.add_argument("--plot", type=Path, default=None, help="also write the loss plot here")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N training files (smoke tests)")
    return ap.parse_args(argv)


class Clock:
    """Seconds since the run started, in front of every log line."""

    def __init__(self) -> None:
        self.start = time.time()

    def log(self, msg: str) -> None:
        print(f"[{time.time() - self.start:7.1f}s] {msg}", flush=True)


def prepare_corpus(args: argparse.Namespace, out: Path, log) -> SimpleNamespace:
    """Step 1 and 2: the stdlib's files split, the held-out texts written to OUT, the chat examples."""
    root = stdlib_root()
    rels = list_stdlib_files(root)
    train_rels, heldout_rels = split_files(rels)
    if args.max_files:
        train_rels = train_rels[: args.max_files]
    train_texts, skipped_train = read_texts(root, train_rels)
    heldout_texts, skipped_heldout = read_texts(root, heldout_rels)
    (out / "heldout_files.txt").write_text("".join(r + "\n" for r in heldout_texts))
    (out / "heldout.txt").write_bytes("\n\n".join(heldout_texts[r] for r in heldout_texts).encode("utf-8"))
    library_heldout = [r for r in heldout_texts if not is_test_file(r)]
    (out / "heldout-library.txt").write_bytes("\n\n".join(heldout_texts[r] for r in library_heldout).encode("utf-8"))
    conversations = chat_examples(train_texts, args.seed)
    log(f"stdlib {root} (Python {platform.python_version()}): {len(rels)} files, {len(train_texts)} train, "
        f"{len(heldout_texts)} held out, {len(skipped_train) + len(skipped_heldout)} not UTF-8; "
        f"{len(conversations)} chat examples")
    return SimpleNamespace(root=root, rels=rels, train_texts=train_texts, heldout_texts=heldout_texts,
                           skipped=skipped_train + skipped_heldout, library_heldout=library_heldout,
                           conversations=conversations)


def tokenize_corpus(args: argparse.Namespace, corpus: SimpleNamespace, out: Path, hf_dir: Path, log) -> SimpleNamespace:
    """Step 3: the tokenizer (trained, or --tokenizer's) saved to OUT/hf, the documents packed into rows."""
    if args.tokenizer:
        hf_tok = load_tokenizer(args.tokenizer)
        log(f"tokenizer from {args.tokenizer}: {len(hf_tok)} tokens")
    else:
        tok = train_tokenizer([corpus.train_texts[r] for r in sorted(corpus.train_texts)], args.vocab_size)
        hf_tok = hf_tokenizer(tok, args.seq_len)
        log(f"trained byte-level BPE tokenizer: {tok.get_vocab_size()} tokens")
    save_tokenizer(hf_tok, hf_dir)
    eot_id = hf_tok.convert_tokens_to_ids(EOT)
    backend = hf_tok.backend_tokenizer
    train_order = sorted(corpus.train_texts)
    code_docs = [e.ids for e in backend.encode_batch([corpus.train_texts[r] for r in train_order],
                                                     add_special_tokens=False)]
    # library modules (not test suites) count --library-weight times in each pass over the data
    weighted = [d for r, d in zip(train_order, code_docs) for _ in range(1 if is_test_file(r) else args.library_weight)]
    chat_texts = [hf_tok.apply_chat_template(c, tokenize=False) for c in corpus.conversations]
    chat_docs = [e.ids for e in backend.encode_batch(chat_texts, add_special_tokens=False)]
    # scored as `hearth perplexity --text-file OUT/heldout.txt` reads it (text mode: "\r\n" -> "\n")
    heldout = {name: hf_tok((out / name).read_text(encoding="utf-8"))["input_ids"]
               for name in ("heldout.txt", "heldout-library.txt")}
    tokens = SimpleNamespace(
        hf_tok=hf_tok, eot_id=eot_id, im_end_id=hf_tok.convert_tokens_to_ids(IM_END),
        rows=pack_documents(weighted + chat_docs, eot_id, args.seq_len, args.seed),
        heldout_ids=heldout["heldout.txt"], heldout_library_ids=heldout["heldout-library.txt"],
        code=sum(map(len, code_docs)), chat=sum(map(len, chat_docs)),
        library=sum(len(d) for r, d in zip(train_order, code_docs) if not is_test_file(r)),
        train_bytes=sum(len(t.encode("utf-8")) for t in corpus.train_texts.values()))
    log(f"training tokens: {tokens.code} code ({tokens.train_bytes / tokens.code:.2f} bytes/token; {tokens.library} of "
        f"them library, weighted x{args.library_weight}) + {tokens.chat} chat -> {tokens.rows.shape[0]} rows of "
        f"{args.seq_len}; held-out tokens: {len(tokens.heldout_ids)}")
    return tokens


def build_model(args: argparse.Namespace, preset: dict, lr: float, vocab_size: int, eot_id: int, log):
    """Step 4's model and optimizer: (LlamaForCausalLM, AdamW, parameters)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=vocab_size, max_position_embeddings=args.seq_len, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id,
        initializer_range=0.02, attention_bias=False, mlp_bias=False, hidden_act="silu", **preset,
    )
    model = LlamaForCausalLM(config)
    model.config._attn_implementation = "sdpa"
    params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), eps=1e-8)
    log(f"model {args.preset}: {params / 1e6:.3f}M parameters ({json.dumps(preset)})")
    return model, opt, params


class StepPlan:
    """How many optimizer steps: --steps, or fitted to the time budget from the speed of steps 3..10
    (the learning-rate schedule needs the total before warmup ends) and shortened where a machine
    shared with other work slows down (the cosine then decays sooner rather than stop undecayed)."""

    CALIBRATE = 10

    def __init__(self, steps: int | None, minutes: float, tokens_per_step: int, log) -> None:
        self.steps, self.fitted = steps, steps is None
        self.minutes, self.tokens_per_step, self.log = minutes, tokens_per_step, log
        self.history: list[tuple[int, int]] = []  # (at step, planned total steps) when fitted
        self.last_fit, self.t_cal = (0, 0.0), 0.0

    def before_step(self, step: int, t_train: float, eval_seconds: float) -> None:
        if self.fitted and step == 2:
            self.t_cal = time.time()  # the first steps are slower: time steps 3..CALIBRATE
        if self.fitted and step == self.CALIBRATE:
            per_step = (time.time() - self.t_cal) / (self.CALIBRATE - 2)
            # what is left of the budget, less ~10 more evaluations (one so far: eval_seconds)
            left = self.minutes * 60 - 10 * eval_seconds - (time.time() - t_train)
            self.steps = max(self.CALIBRATE + 1, int(left / per_step) + self.CALIBRATE)
            self.log(f"{per_step:.2f}s/step ({self.tokens_per_step / per_step:.0f} tokens/s): {self.steps} steps fit "
                     f"{self.minutes:g} minutes")
            self.history.append((step, self.steps))
            self.last_fit = (step, time.time() - t_train)

    def after_evaluation(self, step: int, t_train: float) -> None:
        if not self.fitted or self.steps is None:
            return
        elapsed = time.time() - t_train
        recent = (elapsed - self.last_fit[1]) / max(1, step - self.last_fit[0])
        left = int((self.minutes * 60 - elapsed) / recent)
        if step + left < self.steps * 0.97 and left < self.steps - step:
            self.steps = max(step + 1, step + left)
            self.log(f"slower than planned ({recent:.2f}s/step): now {self.steps} steps")
            self.history.append((step, self.steps))
        self.last_fit = (step, elapsed)


class Training:
    """Step 4's loop: batches from a seeded permutation of the packed rows (a new one each epoch), a
    cosine learning rate with warmup, bf16 autocast, clipped gradients, held-out evaluations."""

    EVAL_WINDOWS = 24

    def __init__(self, args: argparse.Namespace, model, opt, tokens: SimpleNamespace, lr: float,
                 plan: StepPlan, log) -> None:
        import numpy as np

        self.args, self.model, self.opt, self.tokens, self.lr, self.plan, self.log = args, model, opt, tokens, lr, plan, log
        self.rng = np.random.default_rng(args.seed + 1)
        self.perm, self.cursor, self.epoch = self.rng.permutation(tokens.rows.shape[0]), 0, 0
        self.train_loss: list[tuple[int, float]] = []
        self.eval_loss: list[tuple[int, float]] = []
        self.lrs: list[float] = []
        self.eval_seconds, self.step, self.eval_every = 0.0, 0, args.eval_every

    def evaluate(self) -> None:
        t0 = time.time()
        nll, _ = heldout_nll(self.model, self.tokens.heldout_ids, self.args.seq_len, max_windows=self.EVAL_WINDOWS)
        self.eval_seconds += time.time() - t0
        self.eval_loss.append((self.step, nll))
        self.log(f"step {self.step}: held-out loss {nll:.4f} (first {self.EVAL_WINDOWS} windows)")

    def optimizer_step(self, steps: int | None) -> float:
        import numpy as np
        import torch

        batch_size, rows = self.args.batch_size, self.tokens.rows
        if self.cursor + batch_size > len(self.perm):
            self.perm, self.cursor, self.epoch = self.rng.permutation(rows.shape[0]), 0, self.epoch + 1
        batch = torch.from_numpy(rows[self.perm[self.cursor : self.cursor + batch_size]].astype(np.int64))
        self.cursor += batch_size
        lr = lr_at(self.step, steps if steps is not None else 10**9, self.lr, self.args.warmup)
        for g in self.opt.param_groups:
            g["lr"] = lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = self.model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        self.train_loss.append((self.step, loss.item()))
        self.lrs.append(lr)
        return loss.item()

    def run(self) -> float:
        """Train to the plan's end; the seconds it took."""
        t_train = time.time()
        self.evaluate()
        while self.plan.steps is None or self.step < self.plan.steps:
            self.plan.before_step(self.step, t_train, self.eval_seconds)
            steps = self.plan.steps
            if self.eval_every is None and steps is not None:
                self.eval_every = max(1, steps // 10)
            loss = self.optimizer_step(steps)
            if self.step % 25 == 0 or self.step == 1:
                tokens_per_s = self.step * self.args.batch_size * self.args.seq_len / (time.time() - t_train)
                self.log(f"step {self.step}/{steps} loss {loss:.4f} lr {self.lrs[-1]:.2e} epoch {self.epoch} "
                         f"({tokens_per_s:.0f} tokens/s)")
            if self.eval_every and self.step % self.eval_every == 0 and self.step != steps:
                self.evaluate()
                self.plan.after_evaluation(self.step, t_train)
        self.evaluate()
        return time.time() - t_train


def save_and_score(model, tokens: SimpleNamespace, hf_dir: Path, seq_len: int, corpus: SimpleNamespace, log) -> dict:
    """Step 5's Hugging Face folder, then the held-out losses and the samples."""
    from transformers import GenerationConfig

    model.config.use_cache = True
    model.save_pretrained(hf_dir, safe_serialization=True)
    save_tokenizer(tokens.hf_tok, hf_dir)
    GenerationConfig(bos_token_id=tokens.eot_id, eos_token_id=[tokens.eot_id, tokens.im_end_id],
                     pad_token_id=tokens.eot_id, do_sample=False).save_pretrained(hf_dir)
    t0 = time.time()
    nll, scored = heldout_nll(model, tokens.heldout_ids, seq_len)
    log(f"held-out (all {len(corpus.heldout_texts)} files, {scored} tokens, context {seq_len}): "
        f"loss {nll:.4f}, perplexity {math.exp(nll):.3f} ({time.time() - t0:.0f}s)")
    lib_nll, lib_scored = heldout_nll(model, tokens.heldout_library_ids, seq_len)
    log(f"held-out library modules ({len(corpus.library_heldout)} files, {lib_scored} tokens): "
        f"loss {lib_nll:.4f}, perplexity {math.exp(lib_nll):.3f}")
    sample_out = samples(model, tokens.hf_tok)
    for s in sample_out:
        log(f"sample {s['prompt']!r} -> {s['completion']!r}")
    return {"heldout_loss": nll, "heldout_perplexity": math.exp(nll), "heldout_scored_tokens": scored,
            "heldout_library_loss": lib_nll, "heldout_library_perplexity": math.exp(lib_nll),
            "heldout_library_scored_tokens": lib_scored, "samples": sample_out}


def training_record(args: argparse.Namespace, argv: list[str] | None, run: SimpleNamespace) -> dict:
    """The JSON record: settings, data, losses, times, scores (run: preset, lr, minutes, corpus, tokens,
    training, plan, params, train_seconds, scores, clock)."""
    import torch

    training, plan, corpus, tokens, step = run.training, run.plan, run.corpus, run.tokens, run.training.step
    command = ["python", "recipes/train_default_model.py"] + (argv if argv is not None else sys.argv[1:])
    repeat = [a for a in command]
    if args.steps is None and len(plan.history) == 1:
        repeat += ["--steps", str(step)]  # (a plan shortened on the way has no --steps that repeats it)
    tail = [l for _, l in training.train_loss[-50:]]
    return {
        "python": platform.python_version(), "stdlib": str(corpus.root), "platform": platform.platform(),
        "torch": torch.__version__, "command": shlex.join(command),
        "repeat_command": shlex.join(repeat) if args.steps is not None or len(plan.history) == 1 else None,
        "settings": {"preset": args.preset, **run.preset, "lr": run.lr, "warmup": args.warmup, "steps": step,
                     "planned_steps": plan.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "vocab_size": len(tokens.hf_tok), "seed": args.seed, "threads": args.threads, "minutes": run.minutes if args.steps is None else None,
                     "weight_decay": 0.1, "betas": [0.9, 0.95], "grad_clip": 1.0, "lr_final_frac": 0.1,
                     "autocast": "bfloat16", "tokenizer_from": str(args.tokenizer) if args.tokenizer else None},
        "data": {"files": len(corpus.rels), "train_files": len(corpus.train_texts), "heldout_files": len(corpus.heldout_texts),
                 "skipped_not_utf8": corpus.skipped, "train_bytes": tokens.train_bytes,
                 "code_tokens": tokens.code, "library_tokens": tokens.library,
                 "library_weight": args.library_weight, "heldout_library_files": len(corpus.library_heldout), "chat_examples": len(corpus.conversations), "chat_tokens": tokens.chat,
                 "rows": int(tokens.rows.shape[0]), "heldout_tokens": len(tokens.heldout_ids),
                 "epochs_seen": step * args.batch_size / tokens.rows.shape[0]},
        "params": run.params, "train_seconds": run.train_seconds, "eval_seconds": training.eval_seconds,
        "total_seconds": time.time() - run.clock.start, "step_plan": plan.history,
        "final_train_loss_last50": sum(tail) / len(tail), **{k: v for k, v in run.scores.items() if k != "samples"},
        "train_loss": training.train_loss, "eval_loss": training.eval_loss, "lr": training.lrs,
        "samples": run.scores["samples"],
    }


def write_gguf(args: argparse.Namespace, out: Path, hf_dir: Path, log) -> dict | None:
    """The folder converted with hearth's converter (None where hearth is not importable)."""
    gguf = args.gguf or out / f"model-{args.gguf_type}.gguf"
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from hearth.loading.convert import convert_hf_to_gguf
    except ImportError as e:
        log(f"hearth's converter is not available ({e}); convert later: hearth convert {hf_dir} {gguf}")
        return None
    convert_hf_to_gguf(hf_dir, gguf, out_type=args.gguf_type, progress=False)
    log(f"wrote {gguf} ({gguf.stat().st_size / 1e6:.2f} MB)")
    return {"path": str(gguf), "type": args.gguf_type, "bytes": gguf.stat().st_size}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.threads > 1 else "false")
    import torch

    torch.set_num_threads(args.threads)
    preset = dict(PRESETS[args.preset])
    minutes = args.minutes if args.minutes is not None else preset.pop("minutes")
    preset.pop("minutes", None)
    lr = args.lr if args.lr is not None else preset.pop("lr")
    preset.pop("lr", None)
    out: Path = args.out
    hf_dir = out / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    clock = Clock()
    corpus = prepare_corpus(args, out, clock.log)
    tokens = tokenize_corpus(args, corpus, out, hf_dir, clock.log)
    model, opt, params = build_model(args, preset, lr, len(tokens.hf_tok), tokens.eot_id, clock.log)
    plan = StepPlan(args.steps, minutes, args.batch_size * args.seq_len, clock.log)
    training = Training(args, model, opt, tokens, lr, plan, clock.log)
    train_seconds = training.run()
    clock.log(f"trained {training.step} steps in {train_seconds / 60:.1f} min")
    scores = save_and_score(model, tokens, hf_dir, args.seq_len, corpus, clock.log)
    record = training_record(args, argv, SimpleNamespace(
        preset=preset, lr=lr, minutes=minutes, corpus=corpus, tokens=tokens, training=training, plan=plan,
        params=params, train_seconds=train_seconds, scores=scores, clock=clock))
    plot_losses(record, out / "loss.png")
    if args.plot:
        plot_losses(record, args.plot)
    record["gguf"] = write_gguf(args, out, hf_dir, clock.log)
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    clock.log(f"done: {out / 'training.json'}, {out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
