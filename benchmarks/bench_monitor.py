"""What the attention monitor (fadev.torch.shadow(sample_every=k, rows=n)) costs a training step.

A byte-level causal LM -- a Hugging Face LlamaForCausalLM (from_config, random init, attn_implementation=
"sdpa", grouped-query heads; needs transformers) or a torch nn.TransformerEncoder LM (``--model torch``) --
trains with AdamW on windows of the bytes of Python standard-library files. Validated first: with the monitor
at sample_every=1 the loss, logits and gradients of a step are bit-identical to a step without it, and every
layer's logged deviation is finite and at the precision's level (rel_rms below 2^-6 in bf16, 2^-12 in fp32).
Then blocks of ``--steps`` training steps alternate without and with the monitor (sample_every=k, rows=n,
writing CSV and TensorBoard logs to a temporary folder), ``--blocks`` of each, so both arms see the same
machine load; a block is timed from a device synchronisation to another. The monitor keeps its per-layer
counters across its blocks, so at --steps = k every monitored block holds exactly one checked call per layer.

    python benchmarks/bench_monitor.py --threads 1       # CPU: a 0.8M-parameter Llama, sequence 128
    python benchmarks/bench_monitor.py --device cuda     # GPU: a 24M-parameter Llama, sequence 1024, bf16 autocast
    python benchmarks/bench_monitor.py --model torch --device cuda

Besides the two arms' step times it prints the monitor's own host time (naming the calling layer at every
SDPA call; the checks), which on the CPU is the monitor's whole cost, measured inside the monitored steps.
"""
import argparse
import contextlib
import datetime
import glob
import os
import platform
import statistics
import sysconfig
import tempfile
import time

import torch
from torch import nn

import fadev.torch as ft

SIZES = {  # device: (hidden, layers, heads, kv heads, sequence, batch)
    "cpu": (128, 4, 4, 2, 128, 4),
    "cuda": (512, 8, 8, 4, 1024, 8),
}


def text_bytes(limit=8 << 20):
    """The bytes of the standard library's .py files (sorted by path), up to ``limit``."""
    data = bytearray()
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py"))):
        with open(path, "rb") as f:
            data += f.read()
        if len(data) >= limit:
            break
    return torch.frombuffer(data[:limit], dtype=torch.uint8).long()


class TorchLM(nn.Module):
    """Embedding, a causal nn.TransformerEncoder (pre-norm, no dropout), a linear head: SDPA in every layer."""

    def __init__(self, hidden, layers, heads, seq):
        super().__init__()
        self.embed = nn.Embedding(256, hidden)
        self.pos = nn.Parameter(torch.randn(seq, hidden) * 0.02)
        layer = nn.TransformerEncoderLayer(hidden, heads, 4 * hidden, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(hidden, 256)

    def forward(self, ids):
        n = ids.shape[1]
        mask = nn.Transformer.generate_square_subsequent_mask(n, device=ids.device)
        return self.head(self.encoder(self.embed(ids) + self.pos[:n], mask=mask, is_causal=True))


def build(kind, device, seed=0):
    hidden, layers, heads, kv_heads, seq, _ = SIZES[device]
    torch.manual_seed(seed)
    if kind == "llama":
        from transformers import AutoModelForCausalLM, LlamaConfig
        cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=int(2.75 * hidden),
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                          max_position_embeddings=seq, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    else:
        model = TorchLM(hidden, layers, heads, seq)
    return model.to(device).train()


def loss_of(model, batch, kind):
    ids = batch[:, :-1]
    logits = model(input_ids=ids).logits if kind == "llama" else model(ids)
    return nn.functional.cross_entropy(logits.float().reshape(-1, 256), batch[:, 1:].reshape(-1)), logits


class Trainer:
    def __init__(self, kind, device, data, seed=0):
        self.kind, self.device, self.data = kind, device, data
        self.model = build(kind, device, seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda"
                         else contextlib.nullcontext())

    def batch(self):
        _, _, _, _, seq, batch = SIZES[self.device]
        starts = torch.randint(0, len(self.data) - seq - 1, (batch,), generator=self.gen)
        return torch.stack([self.data[s:s + seq + 1] for s in starts.tolist()]).to(self.device)

    def step(self, batch=None):
        batch = self.batch() if batch is None else batch
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            loss, logits = loss_of(self.model, batch, self.kind)
        loss.backward()
        self.opt.step()
        return loss.detach(), logits.detach()


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def validate(kind, device, data):
    """One step with and without the monitor at sample_every=1 gives the same bits; the logged deviations
    are finite and at the precision's level."""
    runs = []
    for monitored in (False, True):
        trainer = Trainer(kind, device, data)
        batch = trainer.batch()  # each run draws the same first batch
        ctx = ft.shadow(sample_every=1, rows=16) if monitored else contextlib.nullcontext()
        with ctx as mon:
            loss, logits = trainer.step(batch)
        grads = [p.grad.clone() for p in trainer.model.parameters()]
        runs.append((loss, logits, grads, mon))
    (loss, logits, grads, _), (loss_m, logits_m, grads_m, mon) = runs
    identical = torch.equal(loss, loss_m) and torch.equal(logits, logits_m)
    if device == "cpu":  # on CUDA the flash backward accumulates dQ with atomics: not reproducible anyway
        identical &= all(torch.equal(a, b) for a, b in zip(grads, grads_m))
    assert identical, "the monitor changed the step"
    df = mon.to_dataframe()
    limit = 2.0 ** -6 if device == "cuda" else 2.0 ** -12
    assert len(df) == SIZES[device][1] and (df["nonfinite"] == 0).all() and (df["rel_rms"] < limit).all(), df
    return df


def clock(monitor):
    """Time the monitor's two pieces of work (naming the calling layer; a check) on the host, into a dict."""
    own = {"names": 0.0, "sample": 0.0}

    def timed(fn, key):
        def run(*args):
            t0 = time.perf_counter()
            try:
                return fn(*args)
            finally:
                own[key] += time.perf_counter() - t0
        return run

    monitor._layer_names, monitor._sample = timed(monitor._layer_names, "names"), timed(monitor._sample, "sample")
    return own


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=sorted(SIZES))
    ap.add_argument("--model", default="llama", choices=["llama", "torch"])
    ap.add_argument("--sample-every", type=int, default=100)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--steps", type=int, default=None, help="steps per block (default: --sample-every)")
    ap.add_argument("--blocks", type=int, default=3, help="blocks per arm, alternating")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or args.sample_every
    data = text_bytes()
    df = validate(args.model, args.device, data)
    print(f"validated: bit-identical step; rel_rms per layer {df['rel_rms'].min():.3g} .. {df['rel_rms'].max():.3g}",
          flush=True)

    trainer = Trainer(args.model, args.device, data)
    params = sum(p.numel() for p in trainer.model.parameters())
    for _ in range(args.warmup):
        trainer.step()
    with tempfile.TemporaryDirectory() as tmp:
        monitor = ft.shadow(sample_every=args.sample_every, rows=args.rows, csv=os.path.join(tmp, "attention.csv"),
                            log_dir=os.path.join(tmp, "tb"))
        own = clock(monitor)
        times = {"off": [], "on": []}
        for block in range(2 * args.blocks):
            arm = ("off", "on")[block % 2]
            with monitor if arm == "on" else contextlib.nullcontext():
                sync(args.device)
                t0 = time.perf_counter()
                for _ in range(steps):
                    trainer.step()
                sync(args.device)
                times[arm].append((time.perf_counter() - t0) / steps)
            print(f"block {block + 1}/{2 * args.blocks} ({arm}): {times[arm][-1] * 1e3:.2f} ms/step", flush=True)
        checks = len(monitor.records)
    off, on = statistics.mean(times["off"]), statistics.mean(times["on"])
    hidden, layers, heads, kv_heads, seq, batch = SIZES[args.device]
    name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or platform.machine()
    print(f"\n{datetime.date.today()}  {name}  torch {torch.__version__}  threads {torch.get_num_threads()}")
    print(f"model {args.model}: {params / 1e6:.1f}M parameters, {layers} layers, {heads} heads ({kv_heads} kv), "
          f"hidden {hidden}, batch {batch} x sequence {seq}; sample_every={args.sample_every}, rows={args.rows}, "
          f"{args.blocks} blocks of {steps} steps per arm, {checks} checks logged")
    print("\n| arm | ms/step (all blocks) | blocks (ms/step) |\n|---|---|---|")
    for arm, t in (("without monitor", times["off"]), ("with monitor", times["on"])):
        print(f"| {arm} | {statistics.mean(t) * 1e3:.2f} | {', '.join(f'{x * 1e3:.2f}' for x in t)} |")
    total = steps * args.blocks
    print(f"\noverhead: {100 * (on / off - 1):+.2f}% of step time (ratio {on / off:.4f}, both arms' time over "
          f"{total} steps)")
    per_step = (own["names"] + own["sample"]) / total
    print(f"monitor's own host time: {own['names'] / total * 1e6:.1f} us/step naming layers "
          f"({monitor.calls / total:.0f} calls/step), {own['sample'] / max(checks, 1) * 1e3:.2f} ms per check x "
          f"{checks} checks = {per_step * 1e3:.3f} ms/step = {100 * per_step / on:.2f}% of the monitored step")


if __name__ == "__main__":
    main()
