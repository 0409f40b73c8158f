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

Without --steps the number of optimizer steps is fitted to --minutes from the speed of the first
steps (the learning-rate schedule depends on the total, so it is fixed before warmup ends); the
JSON record gives the --steps that repeats the run exactly.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import platform
import random
import shlex
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PRESETS = {
    # 5.40M parameters (1.05M of them the tied embedding); f16 GGUF 10.9 MB
    "main": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, lr=2e-3, minutes=35.0),
    # 1.25M parameters (4.3x fewer); same tokenizer, for speculative decoding; f16 GGUF 2.6 MB
    "draft": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=4, num_attention_heads=2,
                  num_key_value_heads=1, lr=3e-3, minutes=10.0),
}

MAX_FILE_BYTES = 200_000
HELDOUT_PER_MILLE = 20  # 2% of the files


# ---------------------------------------------------------------- data


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def list_stdlib_files(root: Path | None = None, max_bytes: int = MAX_FILE_BYTES) -> list[str]:
    """Relative paths (POSIX, sorted) of the standard library's .py files: no site-packages,
    none larger than `max_bytes`."""
    root = root or stdlib_root()
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "dist-packages" in rel.parts or not path.is_file():
            continue
        if path.stat().st_size > max_bytes:
            continue
        out.append(rel.as_posix())
    return sorted(out)


def is_heldout(rel: str, per_mille: int = HELDOUT_PER_MILLE) -> bool:
    """Held out for evaluation or not: a hash of the relative path, the same on every machine."""
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big") % 1000 < per_mille


def split_files(rels: list[str], per_mille: int = HELDOUT_PER_MILLE) -> tuple[list[str], list[str]]:
    train = [r for r in rels if not is_heldout(r, per_mille)]
    heldout = [r for r in rels if is_heldout(r, per_mille)]
    return train, heldout


def is_test_file(rel: str) -> bool:
    """A file of the stdlib's own test suites (test/, tests/, idle_test/ folders, test_*.py)."""
    parts = rel.split("/")
    return any(p in ("test", "tests", "idle_test") for p in parts[:-1]) or parts[-1].startswith("test_")


def read_texts(root: Path, rels: list[str]) -> tuple[dict[str, str], list[str]]:
    """{rel: text} for the files that are UTF-8, and the list of those skipped (not UTF-8)."""
    texts, skipped = {}, []
    for rel in rels:
        try:
            texts[rel] = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(rel)
    return texts, skipped


CHAT_REQUESTS = (
    "{doc}",
    "Write a Python function that does this: {doc}",
    "Write a Python function `{name}`. {doc}",
)


def chat_examples(texts: dict[str, str], seed: int, max_source_chars: int = 1500) -> list[list[dict]]:
    """Conversations made from functions with docstrings: the docstring's first paragraph (in one
    of a few phrasings) is the user's request, the function's source in a ```python block the
    assistant's answer. Test functions, very long functions and repeated docstrings are left out."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    for rel in sorted(texts):
        text = texts[rel]
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("test"):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            para = " ".join(doc.strip().split("\n\n")[0].split())
            if not 20 <= len(para) <= 300 or para in seen:
                continue
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            source = textwrap.dedent("\n".join(lines[start : node.end_lineno])).strip("\n")
            if len(source) > max_source_chars or not source.lstrip().startswith(("def ", "async def ", "@")):
                continue
            seen.add(para)
            request = rng.choice(CHAT_REQUESTS).format(doc=para, name=node.name)
            out.append([{"role": "user", "content": request},
                        {"role": "assistant", "content": f"```python\n{source}\n```"}])
    return out


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (GPT-2 pre-tokenizer regex), special tokens first (ids 0..2); encoding with
    special tokens prepends <|endoftext|> as BOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=len(texts))
    eot_id = tok.token_to_id(EOT)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B:1", special_tokens=[(EOT, eot_id)])
    return tok


def hf_tokenizer(tok, model_max_length: int):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
        additional_special_tokens=[IM_START, IM_END], model_max_length=model_max_length,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(hf, folder: Path) -> None:
    hf.save_pretrained(folder)
    # say plainly what tokenizer.json's post-processor does, for readers of tokenizer_config.json only
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(add_bos_token=True, add_eos_token=False, chat_template=CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def load_tokenizer(folder: Path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(folder)
    if hf.chat_template is None:
        hf.chat_template = CHAT_TEMPLATE
    return hf


# ---------------------------------------------------------------- training


def pack_documents(docs: list[list[int]], eot_id: int, seq_len: int, seed: int):
    """Shuffle the documents (seeded), join them as <|endoftext|> doc <|endoftext|> doc ...,
    cut into rows of seq_len tokens (the tail that does not fill a row is dropped)."""
    import numpy as np

    order = np.random.default_rng(seed).permutation(len(docs))
    total = sum(len(d) + 1 for d in docs)
    stream = np.empty(total, dtype=np.int32)
    i = 0
    for j in order:
        stream[i] = eot_id
        stream[i + 1 : i + 1 + len(docs[j])] = docs[j]
        i += 1 + len(docs[j])
    rows = total // seq_len
    return stream[: rows * seq_len].reshape(rows, seq_len)


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


def main(argv: list[str] | None = None) -> int:
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
    args = ap.parse_args(argv)

    os.environ["RAYON_RS_NUM_CPUS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if args.threads > 1 else "false")
    import numpy as np
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    preset = dict(PRESETS[args.preset])
    minutes = args.minutes if args.minutes is not None else preset.pop("minutes")
    preset.pop("minutes", None)
    lr = args.lr if args.lr is not None else preset.pop("lr")
    preset.pop("lr", None)
    out: Path = args.out
    hf_dir = out / "hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    # ---- data
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
    # scored as `hearth perplexity --text-file OUT/heldout.txt` reads it (text mode: "\r\n" -> "\n")
    heldout_text = (out / "heldout.txt").read_text(encoding="utf-8")
    heldout_library_text = (out / "heldout-library.txt").read_text(encoding="utf-8")
    conversations = chat_examples(train_texts, args.seed)
    log(f"stdlib {root} (Python {platform.python_version()}): {len(rels)} files, {len(train_texts)} train, "
        f"{len(heldout_texts)} held out, {len(skipped_train) + len(skipped_heldout)} not UTF-8; "
        f"{len(conversations)} chat examples")

    # ---- tokenizer
    if args.tokenizer:
        hf_tok = load_tokenizer(args.tokenizer)
        log(f"tokenizer from {args.tokenizer}: {len(hf_tok)} tokens")
    else:
        tok = train_tokenizer([train_texts[r] for r in sorted(train_texts)], args.vocab_size)
        hf_tok = hf_tokenizer(tok, args.seq_len)
        log(f"trained byte-level BPE tokenizer: {tok.get_vocab_size()} tokens")
    save_tokenizer(hf_tok, hf_dir)
    vocab_size = len(hf_tok)
    eot_id = hf_tok.convert_tokens_to_ids(EOT)
    im_end_id = hf_tok.convert_tokens_to_ids(IM_END)
    backend = hf_tok.backend_tokenizer
    train_order = sorted(train_texts)
    code_docs = [e.ids for e in backend.encode_batch([train_texts[r] for r in train_order], add_special_tokens=False)]
    # library modules (not test suites) count --library-weight times in each pass over the data
    weighted = [d for r, d in zip(train_order, code_docs) for _ in range(1 if is_test_file(r) else args.library_weight)]
    library_tokens = sum(len(d) for r, d in zip(train_order, code_docs) if not is_test_file(r))
    chat_texts = [hf_tok.apply_chat_template(c, tokenize=False) for c in conversations]
    chat_docs = [e.ids for e in backend.encode_batch(chat_texts, add_special_tokens=False)]
    rows = pack_documents(weighted + chat_docs, eot_id, args.seq_len, args.seed)
    heldout_ids = hf_tok(heldout_text)["input_ids"]
    heldout_library_ids = hf_tok(heldout_library_text)["input_ids"]
    code_tokens, chat_tokens = sum(map(len, code_docs)), sum(map(len, chat_docs))
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts.values())
    log(f"training tokens: {code_tokens} code ({train_bytes / code_tokens:.2f} bytes/token; {library_tokens} of them "
        f"library, weighted x{args.library_weight}) + {chat_tokens} chat -> {rows.shape[0]} rows of {args.seq_len}; "
        f"held-out tokens: {len(heldout_ids)}")

    # ---- model
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

    # ---- training
    rng = np.random.default_rng(args.seed + 1)
    perm, cursor, epoch = rng.permutation(rows.shape[0]), 0, 0
    eval_windows = 24
    steps = args.steps
    calibrate = 10 if steps is None else None
    budget_s = minutes * 60
    train_loss, eval_loss, lrs = [], [], []
    eval_every = args.eval_every
    t_train = time.time()
    t_eval_total = 0.0
    step = 0
    plan_history = []  # (at step, planned total steps) when --steps is fitted to the time budget
    last_fit = (0, 0.0)

    def evaluate(at: int) -> None:
        nonlocal t_eval_total
        t0 = time.time()
        nll, _ = heldout_nll(model, heldout_ids, args.seq_len, max_windows=eval_windows)
        t_eval_total += time.time() - t0
        eval_loss.append((at, nll))
        log(f"step {at}: held-out loss {nll:.4f} (first {eval_windows} windows)")

    evaluate(0)
    while steps is None or step < steps:
        if calibrate is not None and step == 2:
            t_cal = time.time()  # the first steps are slower: time steps 3..calibrate
        if calibrate is not None and step == calibrate:
            per_step = (time.time() - t_cal) / (calibrate - 2)
            eval_cost = t_eval_total  # one evaluation so far
            # what is left of the budget, less ~10 more evaluations
            steps = max(calibrate + 1, int((budget_s - 10 * eval_cost - (time.time() - t_train)) / per_step) + calibrate)
            log(f"{per_step:.2f}s/step ({args.batch_size * args.seq_len / per_step:.0f} tokens/s): {steps} steps fit "
                f"{minutes:g} minutes")
            plan_history.append((step, steps))
            last_fit = (step, time.time() - t_train)
        if eval_every is None and steps is not None:
            eval_every = max(1, steps // 10)
        if cursor + args.batch_size > len(perm):
            perm, cursor, epoch = rng.permutation(rows.shape[0]), 0, epoch + 1
        batch = torch.from_numpy(rows[perm[cursor : cursor + args.batch_size]].astype(np.int64))
        cursor += args.batch_size
        cur_lr = lr_at(step, steps if steps is not None else 10**9, lr, args.warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        train_loss.append((step, loss.item()))
        lrs.append(cur_lr)
        if step % 25 == 0 or step == 1:
            el = time.time() - t_train
            log(f"step {step}/{steps} loss {loss.item():.4f} lr {cur_lr:.2e} epoch {epoch} "
                f"({step * args.batch_size * args.seq_len / el:.0f} tokens/s)")
        if eval_every and step % eval_every == 0 and step != steps:
            evaluate(step)
            if args.steps is None and steps is not None:
                # a machine shared with other work can slow down: if the plan no longer fits the
                # budget, shorten it (the cosine then decays sooner) rather than stop undecayed
                elapsed = time.time() - t_train
                recent = (elapsed - last_fit[1]) / max(1, step - last_fit[0])
                left = int((budget_s - elapsed) / recent)
                if step + left < steps * 0.97 and left < steps - step:
                    steps = max(step + 1, step + left)
                    log(f"slower than planned ({recent:.2f}s/step): now {steps} steps")
                    plan_history.append((step, steps))
                last_fit = (step, elapsed)
    evaluate(step)
    train_seconds = time.time() - t_train
    log(f"trained {step} steps in {train_seconds / 60:.1f} min")

    # ---- save
    model.config.use_cache = True
    model.save_pretrained(hf_dir, safe_serialization=True)
    save_tokenizer(hf_tok, hf_dir)
    GenerationConfig(bos_token_id=eot_id, eos_token_id=[eot_id, im_end_id], pad_token_id=eot_id,
                     do_sample=False).save_pretrained(hf_dir)

    t0 = time.time()
    nll, scored = heldout_nll(model, heldout_ids, args.seq_len)
    log(f"held-out (all {len(heldout_texts)} files, {scored} tokens, context {args.seq_len}): "
        f"loss {nll:.4f}, perplexity {math.exp(nll):.3f} ({time.time() - t0:.0f}s)")
    lib_nll, lib_scored = heldout_nll(model, heldout_library_ids, args.seq_len)
    log(f"held-out library modules ({len(library_heldout)} files, {lib_scored} tokens): "
        f"loss {lib_nll:.4f}, perplexity {math.exp(lib_nll):.3f}")
    tail = [l for _, l in train_loss[-50:]]
    sample_out = samples(model, hf_tok)
    for s in sample_out:
        log(f"sample {s['prompt']!r} -> {s['completion']!r}")

    command = ["python", "recipes/train_default_model.py"] + (argv if argv is not None else sys.argv[1:])
    repeat = [a for a in command]
    if args.steps is None and len(plan_history) == 1:
        repeat += ["--steps", str(step)]  # (a plan shortened on the way has no --steps that repeats it)
    record = {
        "python": platform.python_version(), "stdlib": str(root), "platform": platform.platform(),
        "torch": torch.__version__, "command": shlex.join(command),
        "repeat_command": shlex.join(repeat) if args.steps is not None or len(plan_history) == 1 else None,
        "settings": {"preset": args.preset, **preset, "lr": lr, "warmup": args.warmup, "steps": step,
                     "planned_steps": steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                     "vocab_size": vocab_size, "seed": args.seed, "threads": args.threads, "minutes": minutes if args.steps is None else None,
                     "weight_decay": 0.1, "betas": [0.9, 0.95], "grad_clip": 1.0, "lr_final_frac": 0.1,
                     "autocast": "bfloat16", "tokenizer_from": str(args.tokenizer) if args.tokenizer else None},
        "data": {"files": len(rels), "train_files": len(train_texts), "heldout_files": len(heldout_texts),
                 "skipped_not_utf8": skipped_train + skipped_heldout, "train_bytes": train_bytes,
                 "code_tokens": code_tokens, "library_tokens": library_tokens,
                 "library_weight": args.library_weight, "heldout_library_files": len(library_heldout), "chat_examples": len(conversations), "chat_tokens": chat_tokens,
                 "rows": int(rows.shape[0]), "heldout_tokens": len(heldout_ids),
                 "epochs_seen": step * args.batch_size / rows.shape[0]},
        "params": params, "train_seconds": train_seconds, "eval_seconds": t_eval_total,
        "total_seconds": time.time() - t_start, "step_plan": plan_history,
        "final_train_loss_last50": sum(tail) / len(tail), "heldout_loss": nll, "heldout_perplexity": math.exp(nll),
        "heldout_scored_tokens": scored, "heldout_library_loss": lib_nll,
        "heldout_library_perplexity": math.exp(lib_nll), "heldout_library_scored_tokens": lib_scored, "train_loss": train_loss, "eval_loss": eval_loss, "lr": lrs,
        "samples": sample_out,
    }
    plot_losses(record, out / "loss.png")
    if args.plot:
        plot_losses(record, args.plot)

    gguf = args.gguf or out / f"model-{args.gguf_type}.gguf"
    try:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from hearth.loading.convert import convert_hf_to_gguf
    except ImportError as e:
        log(f"hearth's converter is not available ({e}); convert later: hearth convert {hf_dir} {gguf}")
        record["gguf"] = None
    else:
        convert_hf_to_gguf(hf_dir, gguf, out_type=args.gguf_type, progress=False)
        record["gguf"] = {"path": str(gguf), "type": args.gguf_type, "bytes": gguf.stat().st_size}
        log(f"wrote {gguf} ({gguf.stat().st_size / 1e6:.2f} MB)")
    (out / "training.json").write_text(json.dumps(record, indent=1) + "\n")
    log(f"done: {out / 'training.json'}, {out / 'loss.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
